//! Integration tests: a real `nats-server` per test (spawned on free loopback
//! ports with its own storage), workers in-process or as real child
//! processes where the test is about a process dying or pausing.

mod artifacts;
mod busy;
mod chaos;
mod cli;
mod cluster;
mod console;
mod effects;
mod lifecycle;
mod liveness;
mod observe;
mod otlp;
mod ownership;
mod perms;
mod promise;
mod providers;
mod readme;
mod reaper;
mod research;
mod retention;
mod schedule;
mod submission;
mod support;
mod watch;
