//! The `justonce` binary end to end: real HTTP on loopback, real databases, a real receiver
//! of the deliveries, and a server killed with SIGKILL.

mod bench;
mod broker_tls;
mod check;
mod environment;
mod first_run;
mod listeners;
mod operations;
mod serve;
mod tls;
mod traces;
