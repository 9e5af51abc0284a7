"""The DMM committee (release of a matrix mechanism, with resharing between committees):
common definitions, client, member and server."""
