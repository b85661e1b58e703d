"""The native clients, beside the mount: a ``torch.distributed.checkpoint`` writer and reader
(``dcp``) and an fsspec filesystem for ``tectonic://`` URLs (``fsspec``), both straight over the
client library so a checkpoint or a dataset skips FUSE and the kernel hop."""
