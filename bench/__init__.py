"""Benchmarks of tectonic-py: each figure beside a ceiling measured in the same run, and a peer.

Run everything with ``python -m bench.run_all``; each script also runs alone with ``--smoke``
(a seconds-long run the test suite uses so the scripts cannot rot) and ``--json``.
"""
