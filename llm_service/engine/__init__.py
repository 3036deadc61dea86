"""The engine: its loop, the scheduler and the ids it schedules (sequences, KV blocks), step timing."""
