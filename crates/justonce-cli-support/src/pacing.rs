//! Pacing for a purge: a pause before each statement, in proportion to how long the one
//! before it took, so that claims running beside it get the database's time. A purge running
//! flat out keeps a core busy in the database, and the claims wait for the CPU, not for locks
//! (docs/benchmarks.md, `justonce bench`).

use std::future::Future;
use std::time::{Duration, Instant};

/// The pause ratio of `justonce purge`, of the scheduled purge of `justonce serve` and of the
/// bench's purge unless told otherwise. On the idle machine claim p99 while purging was a
/// median 4.9x its value without at 0, 2.2x at 10 (up to 3.7x) and 1.3x at 20 (at most
/// 1.65x in ten runs): 20 keeps it within the target of 2x, at about a twenty-fifth of the
/// purge's flat-out speed, still more than 6,000 keys a second (docs/benchmarks.md).
pub const DEFAULT_RATIO: f64 = 20.0;

/// A ratio of pause to work, as `--pause` and `--purge-pause` take it: a number from 0 to
/// 100.
pub fn pause_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=100.0).contains(&ratio) => Ok(ratio),
        _ => Err("expected a number from 0 to 100".to_owned()),
    }
}

/// Runs statements one after the other, each after a pause of `ratio` times as long as the
/// one before it took: the statements get at most `1 / (1 + ratio)` of the time.
pub struct Pacer {
    ratio: f64,
    owed: Duration,
}

impl Pacer {
    /// `ratio` 0 runs flat out.
    pub fn new(ratio: f64) -> Self {
        Self {
            ratio,
            owed: Duration::ZERO,
        }
    }

    /// Waits out the pause the last statement earned, then runs `statement`. The pause comes
    /// before rather than after, so that the last statement of a purge is not followed by one.
    pub async fn run<T>(&mut self, statement: impl Future<Output = T>) -> T {
        // Not even a zero sleep: tokio rounds it up to the next tick of its timer, up to 1 ms.
        if !self.owed.is_zero() {
            tokio::time::sleep(self.owed).await;
        }
        let started = Instant::now();
        let done = statement.await;
        self.owed = started.elapsed().mul_f64(self.ratio);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_statement_waits_ratio_times_the_last_one() {
        let mut pacer = Pacer::new(3.0);
        let statement = Duration::from_millis(20);
        let first = Instant::now();
        pacer.run(tokio::time::sleep(statement)).await;
        let ended = Instant::now();
        // The first statement does not wait; the second waits three times the first.
        let second = pacer.run(async { Instant::now() }).await;
        assert!(second - ended >= statement * 3, "{:?}", second - ended);
        assert!(ended - first >= statement);
    }

    #[tokio::test]
    async fn ratio_zero_owes_no_pause() {
        let mut pacer = Pacer::new(0.0);
        pacer
            .run(tokio::time::sleep(Duration::from_millis(5)))
            .await;
        assert_eq!(pacer.owed, Duration::ZERO);
    }
}
