"""Launchers of local daemons as subprocesses: a whole cluster on one machine
(``local_cluster``) and the etcd cluster its metadata servers may keep their shards in
(``local_etcd``), for ``tectonic cluster up``, the tests, the benchmarks and the load test."""
