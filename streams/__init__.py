"""Streams room: the Faust worker that validates events, keeps user state and joins labels.

Pure cores: `streams.state` (decay, apply_event), `streams.record` (Redis record, read_user_state),
`streams.join` (impression→click/dwell label join), `streams.offline` (the same code without Kafka).
"""
