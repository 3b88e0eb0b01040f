"""Many buffers on one call: follows (follower.py) and writes (writer.py); docs/design/streams.md."""
