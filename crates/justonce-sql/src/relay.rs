//! The relay: takes due outbox rows, hands each to its destination, and records what came
//! of it.

use crate::backend::{Backend, Change, OutboxRow, Wakeups, Which};
use crate::inbox::{millis, random_u64};
use crate::outbox::{Outbox, parse_headers};
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use justonce_core::{Delivered, Delivery, Destination, Error};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How the relay takes, retries and gives up on rows.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    batch_size: u32,
    concurrency: usize,
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
            concurrency: 8,
            lease: Duration::from_secs(60),
            max_attempts: u32::MAX,
            deliver_for: Duration::from_secs(3 * 86_400),
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(3_600),
            poll_interval: Duration::from_secs(1),
        }
    }
}

impl RelayOptions {
    justonce_core::setters!(
        /// Rows taken per round (default 100).
        batch_size: u32,
        /// Deliveries in flight at once within a round (default 8).
        concurrency: usize,
        /// How long a taken row stays hidden from other relays (default 60 s). A round
        /// starts no delivery after half of it has passed; the rows it did not reach are
        /// due again when the lease ends. A relay that dies mid-send leaves its rows due
        /// again after it, too. A destination's timeout must be well within it.
        lease: Duration,
        /// Deliveries tried before a row is dead-lettered (default: no limit, so that
        /// `deliver_for` decides).
        max_attempts: u32,
        /// How long after it was written (or replayed) a row is retried before it is
        /// dead-lettered (default 3 days).
        deliver_for: Duration,
        /// The pause after the first failure, doubled after each next one (default 1 s).
        first_backoff: Duration,
        /// The longest pause between two deliveries of a row (default 1 h), also the cap
        /// on a receiver's `Retry-After`.
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
/// On PostgreSQL rows are taken with `FOR UPDATE SKIP LOCKED` and hidden for a lease in one
/// short statement, so several relays, in one process or many, share the work and no row
/// lock is held during a send. On SQLite run one relay per database file.
///
/// Delivery is at least once: a relay that dies after a send and before recording it, or
/// whose lease runs out mid-send, has that row sent again, with the same key. Only the
/// relay holding a row's lease records its failures.
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
        self,
        name: impl Into<String>,
        destination: impl Destination + 'static,
    ) -> Self {
        self.route(name.into(), Arc::new(destination), None)
    }

    /// Sends rows written for `name` to `destination`, retrying each for `deliver_for`
    /// instead of [`RelayOptions::deliver_for`].
    pub fn destination_for(
        self,
        name: impl Into<String>,
        destination: impl Destination + 'static,
        deliver_for: Duration,
    ) -> Self {
        self.route(name.into(), Arc::new(destination), Some(deliver_for))
    }

    fn route(
        mut self,
        name: String,
        destination: Arc<dyn Destination>,
        deliver_for: Option<Duration>,
    ) -> Self {
        self.destinations.insert(
            name,
            Route {
                destination,
                deliver_for,
            },
        );
        self
    }

    /// Replaces the options.
    pub fn options(mut self, options: RelayOptions) -> Self {
        self.options = options;
        self
    }

    /// Takes one batch of due rows, delivers them (several at once), and records the
    /// results.
    pub async fn relay_once(&self) -> Result<RelayRound, Error> {
        let shared = &self.outbox.shared;
        let token = random_u64() as i64;
        let which = Which::Due {
            lease_ms: millis(self.options.lease),
            limit: i64::from(self.options.batch_size.max(1)),
            token,
        };
        let due = {
            let _writer = shared.queue_writer().await;
            DB::outbox_rows(&shared.pool, &shared.sql, which).await?
        };
        let taken_at = Instant::now();
        // At most `concurrency` deliveries in flight; a finished one makes room for the next.
        let mut waiting = due.iter();
        let mut in_flight = FuturesUnordered::new();
        for row in waiting.by_ref().take(self.options.concurrency.max(1)) {
            in_flight.push(self.deliver_and_record(row, token, taken_at));
        }
        let mut outcomes = Vec::with_capacity(due.len());
        while let Some(outcome) = in_flight.next().await {
            outcomes.push(outcome);
            if let Some(row) = waiting.next() {
                in_flight.push(self.deliver_and_record(row, token, taken_at));
            }
        }
        let mut round = RelayRound {
            taken: due.len(),
            ..RelayRound::default()
        };
        for outcome in outcomes {
            match outcome? {
                Some(Recorded::Sent) => round.sent += 1,
                Some(Recorded::Retried) => round.retried += 1,
                Some(Recorded::Dead) => round.dead += 1,
                None => {}
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
    /// `shutdown` is looked at between rounds, so the round in flight finishes. A database
    /// error is logged and retried after the poll interval.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let shared = &self.outbox.shared;
        let mut wakeups = match DB::outbox_wakeups(&shared.pool, &shared.tables).await {
            Ok(wakeups) => wakeups,
            Err(error) => {
                tracing::warn!(%error, "no notifications: the relay polls");
                Wakeups::none()
            }
        };
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                return Ok(());
            }
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

    /// Delivers one row and records the result under the round's lease `token`; `None`
    /// when the lease was too far gone to start.
    async fn deliver_and_record(
        &self,
        row: &OutboxRow,
        token: i64,
        taken_at: Instant,
    ) -> Result<Option<Recorded>, Error> {
        if taken_at.elapsed() > self.options.lease / 2 {
            return Ok(None);
        }
        let span = tracing::debug_span!(
            "justonce.deliver",
            id = row.id,
            key = %row.key,
            destination = %row.destination,
            attempt = row.attempts,
        );
        let recorded = match self.deliver(row).instrument(span).await {
            Delivered::Sent => {
                self.outbox.change(Change::MarkSent { id: row.id }).await?;
                Recorded::Sent
            }
            Delivered::Retry { after, reason } if !self.exhausted(row) => {
                let backoff = self.backoff(row.attempts);
                // A receiver's Retry-After may lengthen the pause, never shorten it below
                // the backoff nor stretch it past the longest pause.
                let wait = after
                    .map_or(backoff, |after| after.max(backoff))
                    .min(self.options.max_backoff);
                tracing::debug!(id = row.id, attempt = row.attempts, %reason, "delivery failed: retrying later");
                let change = Change::MarkRetry {
                    id: row.id,
                    after_ms: millis(wait),
                    reason: &reason,
                    token,
                };
                self.outbox.change(change).await?;
                Recorded::Retried
            }
            Delivered::Retry { reason, .. } | Delivered::Reject { reason } => {
                tracing::warn!(id = row.id, attempt = row.attempts, %reason, "delivery dead-lettered");
                let change = Change::MarkDead {
                    id: row.id,
                    reason: &reason,
                    token,
                };
                self.outbox.change(change).await?;
                Recorded::Dead
            }
        };
        Ok(Some(recorded))
    }

    async fn deliver(&self, row: &OutboxRow) -> Delivered {
        // A row for a destination this relay does not know may be for one that a newer
        // configuration adds: retry it rather than dead-letter it at once.
        let Some(route) = self.destinations.get(&row.destination) else {
            return Delivered::Retry {
                after: None,
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
        let jitter = random_u64() % (millis(base).unsigned_abs() / 4 + 1);
        base + Duration::from_millis(jitter)
    }
}

/// What was recorded for one delivered row.
enum Recorded {
    Sent,
    Retried,
    Dead,
}
