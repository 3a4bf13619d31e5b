//! The reaper: poison jobs, dead letters, stranded runs (placeholder).
