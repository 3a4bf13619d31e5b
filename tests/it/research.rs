//! The research workload end to end (placeholder).
