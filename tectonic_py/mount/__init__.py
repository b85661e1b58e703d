"""The FUSE mount: pyfuse3 Operations over the client library, and its inode table."""
