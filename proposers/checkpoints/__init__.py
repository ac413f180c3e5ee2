"""A checkpoint on disk: which files make it and whether they are whole (files.py), its weights loaded
strictly into its family's model (load.py), and whether it fits the extracted shards (compatibility.py)."""
