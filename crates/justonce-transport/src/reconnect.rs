//! Connecting again after the broker went away, written once for every consumer and
//! reader: a growing, jittered wait that a shutdown ends at once, the adapter's own
//! connection code, a count in the metrics and a log line with how long the broker was away.

use crate::{Error, Policy};
use std::future::Future;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The wait before the first attempt to connect again; each failed attempt doubles it, up
/// to the policy's `reconnect_max_wait`.
const FIRST_WAIT: Duration = Duration::from_millis(100);

/// What a consumer or reader knows of its connection to the broker, as
/// [`Consumer::link`](crate::Consumer::link) and [`Reader::link`](crate::Reader::link) give
/// it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    /// Receiving from the broker.
    Connected,
    /// The connection was lost for `error`; connecting again.
    Reconnecting {
        /// Why the connection was lost, or why the last attempt to connect again failed.
        error: String,
    },
}

/// Whether `error` means the connection is gone, so that connecting again may help: a
/// broker or TLS failure. A refused setting or a database failure is not.
pub(crate) fn lost_connection(error: &Error) -> bool {
    matches!(error, Error::Broker(_) | Error::Tls(_))
}

/// The wait before attempt `attempt` (from 1) to connect again: [`FIRST_WAIT`] doubling,
/// capped at `max`, of which a random share up to half is taken off so that consumers that
/// lost one broker together do not all come back at the same moment.
pub(crate) fn reconnect_wait(attempt: u32, max: Duration) -> Duration {
    let doubled = FIRST_WAIT.saturating_mul(1 << attempt.saturating_sub(1).min(16));
    let wait = doubled.min(max);
    let half = u64::try_from(wait.as_millis() / 2).unwrap_or(u64::MAX);
    wait - Duration::from_millis(random_u64() % (half + 1))
}

/// 64 random bits, as much as a jitter needs.
fn random_u64() -> u64 {
    std::collections::hash_map::RandomState::new().hash_one(Instant::now())
}

/// The connection state of one consumer or reader, shared with whoever follows its
/// [`Link`]. A clone tells the same followers: a client that connects again by itself
/// (Kafka's) reports its own state through one.
#[derive(Debug, Clone)]
pub(crate) struct Connection {
    link: watch::Sender<Link>,
}

impl Default for Connection {
    fn default() -> Self {
        Self {
            link: watch::Sender::new(Link::Connected),
        }
    }
}

impl Connection {
    /// A receiver of the state, which sees each change.
    pub(crate) fn follow(&self) -> watch::Receiver<Link> {
        self.link.subscribe()
    }

    /// After `lost`, waits and calls `connect` until it succeeds; `None` if `shutdown`
    /// resolved first, which ends a wait or an attempt at once. An attempt that fails with a
    /// connection error is tried again after a longer wait; any other error is returned.
    /// Counted in `justonce_broker_reconnects_total` and logged at warn, with how long the
    /// broker was away.
    pub(crate) async fn reconnect<T, C>(
        &self,
        lost: Error,
        policy: &Policy,
        names: (&str, &'static str),
        shutdown: &mut (impl Future + Unpin),
        connect: impl Fn() -> C,
    ) -> Result<Option<T>, Error>
    where
        C: Future<Output = Result<T, Error>>,
    {
        let away = Instant::now();
        self.lost(lost.to_string());
        let mut attempt = 0;
        loop {
            attempt += 1;
            let wait = reconnect_wait(attempt, policy.reconnect_max_wait);
            let connected = tokio::select! {
                _ = &mut *shutdown => return Ok(None),
                connected = async {
                    tokio::time::sleep(wait).await;
                    connect().await
                } => connected,
            };
            match connected {
                Ok(connected) => {
                    self.back(away, Some(attempt), names);
                    return Ok(Some(connected));
                }
                Err(error) if lost_connection(&error) => {
                    tracing::debug!(%error, attempt, "connecting again failed: trying again");
                    self.still_lost(error.to_string());
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Tells the followers that the connection was lost for `error`, with a warning.
    pub(crate) fn lost(&self, error: String) {
        tracing::warn!(%error, "the connection to the broker was lost: connecting again");
        self.still_lost(error);
    }

    /// Tells the followers why the connection is still lost.
    pub(crate) fn still_lost(&self, error: String) {
        self.link.send_replace(Link::Reconnecting { error });
    }

    /// Tells the followers that the connection lost at `away` is back after `attempts`
    /// attempts (if the caller counts them): counted in `justonce_broker_reconnects_total`
    /// and logged at warn, with how long the broker was away.
    pub(crate) fn back(&self, away: Instant, attempts: Option<u32>, names: (&str, &'static str)) {
        let (consumer, broker) = names;
        let away_ms = u64::try_from(away.elapsed().as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(away_ms, attempts, "connected to the broker again");
        metrics::counter!(RECONNECTS, "consumer" => consumer.to_owned(), "broker" => broker)
            .increment(1);
        self.link.send_replace(Link::Connected);
    }
}

const RECONNECTS: &str = "justonce_broker_reconnects_total";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_from_100_ms_to_its_cap_with_up_to_half_taken_off() {
        let max = Duration::from_secs(5);
        for (attempt, full) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (6, 3_200),
            (7, 5_000),
            (40, 5_000),
        ] {
            for _ in 0..50 {
                let wait = reconnect_wait(attempt, max).as_millis();
                assert!(
                    (full / 2..=full).contains(&wait),
                    "attempt {attempt}: {wait} ms"
                );
            }
        }
        let small = Duration::from_millis(250);
        assert!(reconnect_wait(10, small) <= small);
    }

    #[test]
    fn only_broker_and_tls_failures_are_a_lost_connection() {
        assert!(lost_connection(&Error::Broker("gone".into())));
        assert!(!lost_connection(&Error::Config("bad queue".to_owned())));
        assert!(!lost_connection(&Error::Store(
            justonce_core::Error::Config("down".to_owned())
        )));
    }
}
