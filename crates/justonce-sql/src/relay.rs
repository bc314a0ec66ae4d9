//! The relay: takes due outbox rows, hands each to its destination, and records what came
//! of it.

use crate::backend::{Backend, Change, OutboxRow, Which};
use crate::inbox::{millis, random_u64};
use crate::outbox::{Outbox, parse_headers};
use justonce_core::{Delivered, Delivery, Destination, Error};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How the relay takes, retries and gives up on rows.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    batch_size: u32,
    lease: Duration,
    max_attempts: u32,
    deliver_for: Duration,
    first_backoff: Duration,
    max_backoff: Duration,
    poll_interval: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(60),
            max_attempts: 25,
            deliver_for: Duration::from_secs(3 * 86_400),
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(3_600),
            poll_interval: Duration::from_secs(1),
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $type:ty),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $name: $type) -> Self {
            self.$name = $name;
            self
        }
    )*};
}

impl RelayOptions {
    setters!(
        /// Rows taken per round (default 100).
        batch_size: u32,
        /// How long a taken row stays hidden from other relays (default 60 s). A relay
        /// that dies mid-send leaves its rows due again after this; a send must finish
        /// well within it.
        lease: Duration,
        /// Deliveries tried before a row is dead-lettered (default 25).
        max_attempts: u32,
        /// How long after it was written a row is retried before it is dead-lettered
        /// (default 3 days).
        deliver_for: Duration,
        /// The pause after the first failure, doubled after each next one (default 1 s).
        first_backoff: Duration,
        /// The longest pause between two deliveries of a row (default 1 h).
        max_backoff: Duration,
        /// How often the relay looks for due rows when nothing wakes it (default 1 s). On
        /// PostgreSQL a notification wakes it as soon as a row is committed; the poll
        /// catches notifications lost across a reconnect.
        poll_interval: Duration,
    );
}

/// What one round of the relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows taken.
    pub taken: usize,
    /// Rows the destination took.
    pub sent: usize,
    /// Rows put back to be tried again later.
    pub retried: usize,
    /// Rows dead-lettered.
    pub dead: usize,
}

/// Sends outbox rows to their destinations. Made by [`Outbox::relay`].
///
/// On PostgreSQL rows are taken with `FOR UPDATE SKIP LOCKED` and hidden for a lease in a
/// short transaction, so several relays, in one process or many, share the work and no
/// row lock is held during a send. On SQLite run one relay per database file: two are
/// safe, but they queue for the file's single write lock.
///
/// Delivery is at least once: a relay that dies after a send and before recording it sends
/// that row again after the lease, with the same key.
pub struct Relay<DB: Backend> {
    outbox: Outbox<DB>,
    destinations: HashMap<String, Route>,
    options: RelayOptions,
}

/// A registered destination, with its own delivery window if it has one.
struct Route {
    destination: Arc<dyn Destination>,
    deliver_for: Option<Duration>,
}

impl<DB: Backend> Outbox<DB> {
    /// A relay for this outbox with default options and no destinations yet.
    pub fn relay(&self) -> Relay<DB> {
        Relay {
            outbox: self.clone(),
            destinations: HashMap::new(),
            options: RelayOptions::default(),
        }
    }
}

impl<DB: Backend> Relay<DB> {
    /// Sends rows written for `name` to `destination`.
    pub fn destination(
        mut self,
        name: impl Into<String>,
        destination: impl Destination + 'static,
    ) -> Self {
        let route = Route {
            destination: Arc::new(destination),
            deliver_for: None,
        };
        self.destinations.insert(name.into(), route);
        self
    }

    /// Sends rows written for `name` to `destination`, retrying each for `deliver_for`
    /// after it was written instead of [`RelayOptions::deliver_for`].
    pub fn destination_for(
        mut self,
        name: impl Into<String>,
        destination: impl Destination + 'static,
        deliver_for: Duration,
    ) -> Self {
        let route = Route {
            destination: Arc::new(destination),
            deliver_for: Some(deliver_for),
        };
        self.destinations.insert(name.into(), route);
        self
    }

    /// Replaces the options.
    pub fn options(mut self, options: RelayOptions) -> Self {
        self.options = options;
        self
    }

    /// Takes one batch of due rows, delivers each, and records the results.
    pub async fn relay_once(&self) -> Result<RelayRound, Error> {
        let shared = &self.outbox.shared;
        let which = Which::Due {
            lease_ms: millis(self.options.lease),
            limit: i64::from(self.options.batch_size.max(1)),
        };
        let due = DB::outbox_rows(&shared.pool, &shared.sql, which).await?;
        let mut round = RelayRound {
            taken: due.len(),
            ..RelayRound::default()
        };
        for row in due {
            match self.deliver(&row).await {
                Delivered::Sent => {
                    self.outbox.change(Change::MarkSent { id: row.id }).await?;
                    round.sent += 1;
                }
                Delivered::Retry { after, reason } if !self.exhausted(&row) => {
                    let wait = after.unwrap_or_else(|| self.backoff(row.attempts));
                    tracing::debug!(id = row.id, attempt = row.attempts, %reason, "delivery failed: retrying later");
                    let change = Change::MarkRetry {
                        id: row.id,
                        after_ms: millis(wait),
                        reason: &reason,
                    };
                    self.outbox.change(change).await?;
                    round.retried += 1;
                }
                Delivered::Retry { reason, .. } | Delivered::Reject { reason } => {
                    tracing::warn!(id = row.id, attempt = row.attempts, %reason, "delivery dead-lettered");
                    let change = Change::MarkDead {
                        id: row.id,
                        reason: &reason,
                    };
                    self.outbox.change(change).await?;
                    round.dead += 1;
                }
            }
        }
        for (outcome, count) in [
            ("sent", round.sent),
            ("retried", round.retried),
            ("dead", round.dead),
        ] {
            if count > 0 {
                metrics::counter!("justonce_deliveries_total", "outcome" => outcome)
                    .increment(count as u64);
            }
        }
        Ok(round)
    }

    /// Relays until `shutdown` resolves: a round, and another at once while rounds find
    /// rows; otherwise it waits for a notification (PostgreSQL) or the poll interval.
    /// A database error is logged and retried after the poll interval.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let shared = &self.outbox.shared;
        let mut wakeups = DB::outbox_wakeups(&shared.pool, &shared.tables).await?;
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let busy = match self.relay_once().await {
                Ok(round) => round.taken > 0,
                Err(error) => {
                    tracing::warn!(%error, "relay round failed");
                    false
                }
            };
            if busy {
                continue;
            }
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = wakeups.wait() => {}
                () = tokio::time::sleep(self.options.poll_interval) => {}
            }
        }
    }

    async fn deliver(&self, row: &OutboxRow) -> Delivered {
        let Some(route) = self.destinations.get(&row.destination) else {
            return Delivered::Reject {
                reason: format!(
                    "no destination named {:?} is registered with the relay",
                    row.destination
                ),
            };
        };
        let headers = match parse_headers(&row.headers) {
            Ok(headers) => headers,
            Err(error) => {
                return Delivered::Reject {
                    reason: error.to_string(),
                };
            }
        };
        let delivery = Delivery {
            id: row.id,
            key: &row.key,
            destination: &row.destination,
            payload: &row.payload,
            headers: &headers,
            attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
        };
        route.destination.deliver(delivery).await
    }

    fn exhausted(&self, row: &OutboxRow) -> bool {
        let deliver_for = self
            .destinations
            .get(&row.destination)
            .and_then(|route| route.deliver_for)
            .unwrap_or(self.options.deliver_for);
        row.attempts >= i64::from(self.options.max_attempts) || row.age_ms >= millis(deliver_for)
    }

    /// The pause after the `attempts`th failure: doubling from the first backoff up to the
    /// longest, with up to a quarter of it added at random so that rows failed together
    /// spread out.
    fn backoff(&self, attempts: i64) -> Duration {
        let doublings = u32::try_from(attempts.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(30);
        let base = self
            .options
            .first_backoff
            .saturating_mul(1 << doublings)
            .min(self.options.max_backoff);
        let jitter = random_u64() % (millis(base) as u64 / 4 + 1);
        base + Duration::from_millis(jitter)
    }
}
