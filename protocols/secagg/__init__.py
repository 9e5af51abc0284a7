"""SecAgg+ (Bell et al., CCS 2020): common definitions, client and server."""
