"""gemma4-optb: a slim deploy-path server for Gemma-4 on AWS Inferentia2."""
