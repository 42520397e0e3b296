"""The versioned bundle: layout constants, manifest, writer. The reader is runtime/bundle/reader.py."""
