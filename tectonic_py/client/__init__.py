"""The client library: the path API, writers and readers, block I/O against chunk stores and
the metadata client. The mount, the CLI, the load test and maintenance are thin layers over it."""
