"""The committee secure sum: common definitions, client, member and server."""
