"""`slimish plan`: a job's memory, weight-sync time and binding wall, from its config and config.json alone."""
