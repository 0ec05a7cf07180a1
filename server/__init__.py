"""gemma4-optb: a slim deploy-path server for Gemma-4 on AWS Inferentia2.

Packages, top to bottom (each imports only those below it; pyproject.toml's import contracts check it):
tools -> app -> api -> engine | protocol -> sampling -> constraints -> graphs -> model. vendor/ is the compile recipe.
"""
