"""gemma4-optb: a slim deploy-path server for Gemma-4 on AWS Inferentia2. Packages, each importing only those below it
(pyproject.toml's import contracts): tools -> app -> api -> engine | protocol -> sampling -> constraints -> graphs -> model."""
