"""Reading what a merge starts from: checkpoints (a Hub id or a local folder: config, weight files read tensor by
tensor, the model libraries behind one interface), their canonical graphs and the models built back from them,
and data (text, token files and images) for evaluation and learned matching."""
