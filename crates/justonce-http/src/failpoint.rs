//! Named points where a fault test kills the process: compiled only with the `failpoints`
//! feature, and armed only when `JUSTONCE_FAILPOINT` names the point.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The first request to reach the armed point prints `paused <name>` on stdout and never
/// goes on, so that the test can kill the process there; later requests pass.
pub(crate) async fn pause(name: &str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    static REACHED: AtomicBool = AtomicBool::new(false);
    let armed = ARMED.get_or_init(|| std::env::var("JUSTONCE_FAILPOINT").ok());
    if armed.as_deref() == Some(name) && !REACHED.swap(true, Ordering::SeqCst) {
        println!("paused {name}");
        std::future::pending::<()>().await;
    }
}
