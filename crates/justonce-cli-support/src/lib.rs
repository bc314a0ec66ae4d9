//! What the `justonce` command and its bench share: bad usage (exit code 2), which database
//! a URL names, the pacing of a purge, progress lines on standard error, durations as the
//! settings write them, times as the commands take them, and the signal to stop.

pub mod database;
pub mod pacing;
pub mod progress;
mod time;
mod usage;

pub use time::{parse_ago, parse_time};
pub use usage::Usage;

use anyhow::{Result, anyhow, bail};
use std::time::Duration;

/// `90s`, `5m`, `36h`, `7d`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| anyhow!("{text:?} needs a unit: ms, s, m, h or d"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| anyhow!("{text:?} is not a duration such as 5m or 3d"))?;
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => bail!("{text:?} has an unknown unit: use ms, s, m, h or d"),
    };
    // Durations are added to clocks and stored as milliseconds: a century is plenty, and
    // far from where either overflows.
    match number.checked_mul(millis_per_unit) {
        Some(millis) if millis <= MAX_DURATION.as_millis() as u64 => {
            Ok(Duration::from_millis(millis))
        }
        _ => bail!("{text:?} is too long: at most 36500d"),
    }
}

/// The longest duration any setting takes.
const MAX_DURATION: Duration = Duration::from_secs(36_500 * 86_400);

/// SIGINT (Ctrl-C) or SIGTERM, listened for from this call on: a signal that comes before
/// the future is first polled still ends it, instead of the signal's default action ending
/// the process. Call it within the runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = signal(SignalKind::interrupt()).ok();
    let terminate = signal(SignalKind::terminate()).ok();
    async move {
        tokio::select! {
            () = received(interrupt) => {}
            () = received(terminate) => {}
        }
    }
}

/// The next signal `listener` receives; never, without a listener.
async fn received(listener: Option<tokio::signal::unix::Signal>) {
    match listener {
        Some(mut listener) => {
            listener.recv().await;
        }
        None => std::future::pending().await,
    }
}
