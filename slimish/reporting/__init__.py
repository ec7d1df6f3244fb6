"""`slimish report RUN_DIR`: a run's metrics as plots, in a self-contained web page and as PNGs."""
