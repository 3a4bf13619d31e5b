//! Integration tests: a real `nats-server` per test (spawned on free loopback
//! ports with its own storage), workers in-process or as real child
//! processes where the test is about a process dying or pausing.

mod artifacts;
mod busy;
mod chaos;
mod charts;
mod children;
mod cli;
mod cluster;
mod console;
mod console_cost;
mod effects;
mod invoice;
mod journal;
mod lifecycle;
mod limits;
mod liveness;
mod observe;
mod otlp;
mod ownership;
mod perms;
mod promise;
mod providers;
mod readme;
mod real_model;
mod reaper;
mod remote;
mod research;
mod retention;
mod schedule;
mod sdk;
mod search;
mod serial;
mod shutdown;
mod signals;
mod submission;
mod tenants;
mod timers;
mod watch;
mod waterfall;
