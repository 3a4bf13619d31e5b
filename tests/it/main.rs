//! Integration tests: a real `nats-server` per test (spawned on free loopback
//! ports with its own storage), workers in-process or as real child
//! processes where the test is about a process dying or pausing.

mod chaos;
mod cli;
mod cluster;
mod effects;
mod lifecycle;
mod liveness;
mod ownership;
mod reaper;
mod research;
mod submission;
mod support;
