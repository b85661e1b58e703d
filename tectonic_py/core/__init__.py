"""The bottom of the house: wire framing and auth, errors, ids, checksums, capabilities, EC
policy, the cluster file and the records client and servers share. It imports nothing else of
the project, so every other package may stand on it."""
