"""dpltm.data: datasets, files, downloads."""
