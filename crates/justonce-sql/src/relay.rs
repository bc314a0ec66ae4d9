//! The relay: takes due outbox rows, hands each to its destination, and records what came
//! of it.

use crate::backend::{Backend, Queries};
use crate::outbox::{Outbox, headers_of, is_trace_header, parse_headers};
use crate::rows::{Change, OutboxRow, Tried, Wakeups, Which};
use crate::shared::{in_batches, millis, random_u64};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use justonce_core::trace::{self, TraceContext};
use justonce_core::{Answer, Delivered, Delivery, Destination, Error};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How the relay takes, retries and gives up on rows.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    batch_size: u32,
    concurrency: usize,
    per_destination: usize,
    per_destination_total: usize,
    breaker_failures: u32,
    breaker_pause: Duration,
    lease: Duration,
    max_attempts: u32,
    deliver_for: Duration,
    first_backoff: Duration,
    max_backoff: Duration,
    poll_interval: Duration,
}

impl RelayOptions {
    /// The default deliveries in flight at once over all destinations.
    pub const DEFAULT_CONCURRENCY: usize = 16;
    /// The default deliveries in flight at once to one destination for one scope.
    pub const DEFAULT_PER_DESTINATION: usize = 8;
    /// The default deliveries in flight at once to one destination over all its scopes.
    pub const DEFAULT_PER_DESTINATION_TOTAL: usize = 16;
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            concurrency: Self::DEFAULT_CONCURRENCY,
            per_destination: Self::DEFAULT_PER_DESTINATION,
            per_destination_total: Self::DEFAULT_PER_DESTINATION_TOTAL,
            breaker_failures: 5,
            breaker_pause: Duration::from_secs(10),
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
        /// Deliveries in flight at once (default 16).
        concurrency: usize,
        /// Deliveries in flight at once to one destination for one scope (a lane), under
        /// [`Relay::run`] (default 8): a lane that is slow or down holds no more, and the
        /// others keep the rest. Rows without a scope are one lane of their destination.
        per_destination: usize,
        /// Deliveries in flight at once to one destination over all its scopes, under
        /// [`Relay::run`] (default 16, never below `per_destination`): many tenants do not
        /// add up to more than this at one destination. Above `per_destination`, so that
        /// one tenant's slow lane leaves room for the others.
        per_destination_total: usize,
        /// Failures in a row (a timeout, a connection error, a 5xx or 429) after which
        /// [`Relay::run`] backs off a lane, a destination for one scope (default 5): its
        /// rows wait, untried, for the breaker's pause. The destination's other scopes
        /// keep their own breakers.
        breaker_failures: u32,
        /// The breaker's first pause (default 10 s). When it ends, one delivery goes through:
        /// if it fails, the pause doubles (up to 32 times the first); if the destination
        /// answers, the breaker closes.
        breaker_pause: Duration,
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
        /// How often the relay looks for due rows when nothing wakes it (default 1 s). A
        /// row forwarded through [`Inbox::run_forward`](crate::Inbox::run_forward) of its
        /// own process wakes it at once. On PostgreSQL a notification wakes it for rows
        /// committed elsewhere; the poll catches notifications lost across a reconnect.
        poll_interval: Duration,
    );
}

/// What one round of the relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows taken. A row replayed, dead-lettered or taken over while it was sent, its
    /// outcome not recorded, counts here alone.
    pub taken: usize,
    /// Rows the destination took, recorded as sent.
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
/// relay holding a row's lease records what came of its delivery: a replay takes the row
/// from its holder, so that a slow relay's late answer does not undo it.
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

    /// Takes up to `limit` due rows under a lease token of their own, none for the lanes
    /// `held_back` (JSON, as [`Which::Due`] reads it).
    async fn take(&self, limit: usize, held_back: String) -> Result<Taken, Error> {
        let shared = &self.outbox.shared;
        let token = random_u64() as i64;
        let which = Which::Due {
            lease_ms: millis(self.options.lease),
            limit: i64::try_from(limit.max(1)).unwrap_or(i64::MAX),
            token,
            held_back,
        };
        let rows = {
            let _writer = shared.queue_writer().await;
            shared.sql.outbox_rows(&shared.pool, which).await?
        };
        Ok(Taken {
            rows,
            token,
            at: Instant::now(),
        })
    }

    /// Takes one batch of due rows, delivers them (several at once), and records the
    /// results.
    pub async fn relay_once(&self) -> Result<RelayRound, Error> {
        let taken = self
            .take(self.options.batch_size.max(1) as usize, "[]".to_owned())
            .await?;
        // At most `concurrency` deliveries in flight; a finished one makes room for the next.
        let mut waiting = taken.rows.iter();
        let mut in_flight = FuturesUnordered::new();
        for row in waiting.by_ref().take(self.options.concurrency.max(1)) {
            in_flight.push(self.deliver_and_record(row, taken.token, taken.at));
        }
        let mut outcomes = Vec::with_capacity(taken.rows.len());
        while let Some(outcome) = in_flight.next().await {
            outcomes.push(outcome);
            if let Some(row) = waiting.next() {
                in_flight.push(self.deliver_and_record(row, taken.token, taken.at));
            }
        }
        let mut round = RelayRound {
            taken: taken.rows.len(),
            ..RelayRound::default()
        };
        for (row, outcome) in taken.rows.iter().zip(outcomes) {
            if let Some(settled) = outcome? {
                round.count(&row.destination, settled.recorded);
            }
        }
        Ok(round)
    }

    /// Relays until `shutdown` resolves, keeping up to `concurrency` deliveries in flight
    /// in lanes, one for each destination and scope: a finished one makes room for due
    /// rows of any lane that is not at its `per_destination` cap, whose destination is not
    /// at its `per_destination_total`, and that its breaker does not back off. So a slow
    /// or broken destination never holds back the others, nor one tenant's backlog at a
    /// destination the other tenants' deliveries. Lanes with rows ready take turns. With
    /// nothing due it waits for a commit of this process, a notification (PostgreSQL) or
    /// the poll interval. A database error is logged and retried; at `shutdown` the
    /// deliveries in flight finish and are recorded.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let shared = &self.outbox.shared;
        let wakeups = match DB::outbox_wakeups(&shared.pool, &shared.tables).await {
            Ok(wakeups) => wakeups,
            Err(error) => {
                tracing::warn!(%error, "no notifications: the relay polls");
                Wakeups::none()
            }
        };
        let mut wakeups = wakeups.and_commits(shared.relays.subscribe());
        let concurrency = self.options.concurrency.max(1);
        let mut lanes = Lanes::default();
        let mut in_flight = FuturesUnordered::new();
        // What a moving breaker writes; polled beside the deliveries, as the take is.
        let mut breakers = FuturesUnordered::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut take_failing = false;
        loop {
            let room = concurrency - in_flight.len();
            let mut more_due = false;
            // Rows are taken a few at a time, not one per finished delivery.
            if room > 0 && (2 * room >= concurrency || in_flight.is_empty()) {
                let limit = room.min(self.options.per_destination.max(1));
                let held_back = lanes.held_back(&self.options, Instant::now());
                let take = self.take(limit, held_back);
                let mut take = std::pin::pin!(take);
                // The deliveries in flight go on meanwhile: one may hold the connection or
                // the writer's place that the take waits for.
                let mut settled = false;
                let taken = loop {
                    tokio::select! {
                        taken = &mut take => break taken,
                        Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                            let (lane, outcome): (LaneId, _) = done;
                            if let Some(moved) = lanes.settle(&lane, outcome, &self.options) {
                                breakers.push(self.record_breaker(moved));
                            }
                            settled = true;
                        }
                        Some(()) = breakers.next(), if !breakers.is_empty() => {}
                    }
                };
                match taken {
                    Ok(taken) => {
                        if take_failing {
                            tracing::info!("taking due rows works again");
                            take_failing = false;
                        }
                        // A lane held back from this take may have room again.
                        more_due = taken.rows.len() == limit || settled;
                        lanes.queue(taken);
                    }
                    // A database outage fails every take: one line when it starts.
                    Err(error) if take_failing => {
                        tracing::debug!(%error, "taking due rows failed again");
                    }
                    Err(error) => {
                        tracing::warn!(%error, "taking due rows failed: trying again");
                        take_failing = true;
                    }
                }
            }
            while in_flight.len() < concurrency {
                let Some((row, token, taken_at)) = lanes.next_ready(&self.options) else {
                    break;
                };
                in_flight.push(self.deliver_owned(row, token, taken_at));
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some((lane, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                    if let Some(moved) = lanes.settle(&lane, outcome, &self.options) {
                        breakers.push(self.record_breaker(moved));
                    }
                }
                Some(()) = breakers.next(), if !breakers.is_empty() => {}
                () = std::future::ready(()), if more_due && in_flight.len() < concurrency => {}
                () = wakeups.wait() => {}
                () = tokio::time::sleep(self.options.poll_interval) => {}
            }
        }
        loop {
            tokio::select! {
                Some((lane, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                    if let Some(moved) = lanes.settle(&lane, outcome, &self.options) {
                        breakers.push(self.record_breaker(moved));
                    }
                }
                Some(()) = breakers.next(), if !breakers.is_empty() => {}
                else => break,
            }
        }
        Ok(())
    }

    /// [`Relay::deliver_and_record`] for a row it owns, named by its lane.
    async fn deliver_owned(
        &self,
        row: OutboxRow,
        token: i64,
        taken_at: Instant,
    ) -> (LaneId, Result<Option<Settled>, Error>) {
        let outcome = self.deliver_and_record(&row, token, taken_at).await;
        if let Ok(Some(settled)) = &outcome {
            count_delivery(&row.destination, settled.recorded);
        }
        ((row.destination, row.scope), outcome)
    }

    /// Delivers one row and records the result under the round's lease `token`; `None`
    /// when the lease was too far gone to start.
    async fn deliver_and_record(
        &self,
        row: &OutboxRow,
        token: i64,
        taken_at: Instant,
    ) -> Result<Option<Settled>, Error> {
        if taken_at.elapsed() > self.options.lease / 2 {
            self.untake(row, token, Duration::ZERO).await?;
            return Ok(None);
        }
        let headers = parse_headers(&row.headers);
        let span = tracing::debug_span!(
            "justonce.deliver",
            otel.kind = "client",
            id = row.id,
            key = %row.key,
            destination = %row.destination,
            attempt = row.attempts,
        );
        // The delivery continues the trace of the work that wrote the row.
        let stored = headers
            .as_ref()
            .ok()
            .and_then(|headers| TraceContext::from_headers(headers_of(headers)));
        if let Some(stored) = &stored {
            trace::set_parent(&span, stored);
        }
        let started = Instant::now();
        let (delivered, answer) = self.deliver(row, headers).instrument(span).await;
        let answer_start = answer
            .body_start
            .as_deref()
            .map(|body| safe_text(body, ANSWER_BYTES));
        let tried = Tried {
            duration_ms: millis(started.elapsed()),
            status: answer.status.map(i64::from),
            answer: answer_start.as_deref(),
        };
        // A destination that did not answer, or answered "not now"; an unknown one is no
        // destination's failure.
        let unwell = matches!(delivered, Delivered::Retry { .. })
            && self.destinations.contains_key(&row.destination);
        let (recorded, changed) = match delivered {
            Delivered::Sent => {
                let changed = self
                    .outbox
                    .change(Change::MarkSent {
                        id: row.id,
                        token,
                        tried,
                    })
                    .await?;
                // A send the store did not record (a replay took the row) is timed by the
                // replay's own delivery.
                if changed > 0 {
                    let waited = Duration::from_millis(row.age_ms.max(0).unsigned_abs())
                        + taken_at.elapsed();
                    metrics::histogram!(DELIVERED_SECONDS, "destination" => row.destination.clone())
                        .record(waited.as_secs_f64());
                }
                if changed > 0 && row.last_error.is_some() {
                    tracing::info!(
                        id = row.id,
                        key = %row.key,
                        destination = %row.destination,
                        attempt = row.attempts,
                        "delivered after failing"
                    );
                }
                (Recorded::Sent, changed)
            }
            Delivered::Retry { after, reason } if !self.exhausted(row) => {
                let backoff = self.backoff(row.attempts);
                // A receiver's Retry-After may lengthen the pause, never shorten it below
                // the backoff nor stretch it past the longest pause.
                let wait = after
                    .map_or(backoff, |after| after.max(backoff))
                    .min(self.options.max_backoff);
                // A row's first failure is worth a line; the next ones, until it is
                // delivered or dead-lettered, are not.
                if row.last_error.is_none() {
                    tracing::warn!(
                        id = row.id,
                        key = %row.key,
                        destination = %row.destination,
                        attempt = row.attempts,
                        %reason,
                        "delivery failing: retrying later"
                    );
                } else {
                    tracing::debug!(id = row.id, attempt = row.attempts, %reason, "delivery failed: retrying later");
                }
                let failure = Failure::Retry {
                    after_ms: millis(wait),
                };
                let changed = (self.record_failure(row.id, token, failure, &reason, tried)).await?;
                (Recorded::Retried, changed)
            }
            Delivered::Retry { reason, .. } | Delivered::Reject { reason } => {
                tracing::warn!(
                    id = row.id,
                    key = %row.key,
                    destination = %row.destination,
                    attempt = row.attempts,
                    %reason,
                    "delivery dead-lettered"
                );
                let changed =
                    (self.record_failure(row.id, token, Failure::Dead, &reason, tried)).await?;
                (Recorded::Dead, changed)
            }
        };
        // An outcome is recorded only under the lease token, and a failure only on a row
        // still due: a replay, another relay after the lease ran out, or a dead-lettering
        // past the row's window came first. The counts follow the store, not this send.
        let recorded = if changed == 0 {
            tracing::debug!(
                id = row.id,
                "the row was replayed, dead-lettered or taken over while it was sent: its outcome is not recorded"
            );
            Recorded::Superseded
        } else {
            recorded
        };
        Ok(Some(Settled { recorded, unwell }))
    }

    /// Records a failed delivery with its reason, made safe to store, and its attempt.
    /// Should the database refuse it still, the failure is recorded again with a plain
    /// reason and no answer: a row whose failure goes unrecorded would be sent again when its
    /// lease ends, outside its schedule, and never reach its dead letter. Returns the rows
    /// changed: none when the lease was taken away.
    async fn record_failure(
        &self,
        id: i64,
        token: i64,
        failure: Failure,
        reason: &str,
        tried: Tried<'_>,
    ) -> Result<u64, Error> {
        let change = |reason, tried| match failure {
            Failure::Retry { after_ms } => Change::MarkRetry {
                id,
                after_ms,
                reason,
                token,
                tried,
            },
            Failure::Dead => Change::MarkDead {
                id,
                reason,
                token,
                tried,
            },
        };
        let reason = safe_text(reason, REASON_BYTES);
        let error = match self.outbox.change(change(&reason, tried)).await {
            Ok(changed) => return Ok(changed),
            Err(error) => error,
        };
        metrics::counter!("justonce_relay_record_failures_total").increment(1);
        tracing::warn!(id, %error, "a failed delivery's reason could not be recorded: recording the failure without it");
        let bare = Tried {
            answer: None,
            ..tried
        };
        self.outbox.change(change(UNRECORDED_REASON, bare)).await
    }

    /// Gives back a row taken under `token` and not tried, due again `after` from now with
    /// its attempt uncounted, so that it waits no longer than that and stays on its
    /// schedule to a dead letter.
    async fn untake(&self, row: &OutboxRow, token: i64, after: Duration) -> Result<(), Error> {
        self.outbox
            .change(Change::Untake {
                id: row.id,
                after_ms: millis(after),
                token,
            })
            .await
            .map(drop)
    }

    /// Writes a breaker's move for `justonce stats`, and when it opened, backs its lane
    /// off.
    async fn record_breaker(&self, moved: BreakerMoved) {
        let ((destination, scope), change) = match &moved {
            BreakerMoved::Opened(opened) => (
                &opened.lane,
                Change::BreakerOpen {
                    destination: &opened.lane.0,
                    scope: &opened.lane.1,
                    failures: i64::from(opened.failures),
                    pause_ms: millis(opened.pause),
                },
            ),
            BreakerMoved::Closed(lane) => (
                lane,
                Change::BreakerClose {
                    destination: &lane.0,
                    scope: &lane.1,
                },
            ),
        };
        if let Err(error) = self.outbox.change(change).await {
            tracing::warn!(%destination, %scope, %error, "recording the destination's breaker failed");
        }
        if let BreakerMoved::Opened(opened) = moved {
            self.back_off(opened).await;
        }
    }

    /// What a breaker's opening does in the database: the rows it kept waiting are given
    /// back, due when its pause ends, and the lane's rows past their delivery window are
    /// dead-lettered now rather than one per probe.
    async fn back_off(&self, opened: Opened) {
        let (destination, scope) = &opened.lane;
        for (row, token) in &opened.untried {
            if let Err(error) = self.untake(row, *token, opened.pause).await {
                tracing::warn!(id = row.id, %error, "giving back an untried row failed: it is due when its lease ends");
            }
        }
        let deliver_for = self
            .destinations
            .get(destination)
            .and_then(|route| route.deliver_for)
            .unwrap_or(self.options.deliver_for);
        let reason = format!(
            "not delivered within {}s while the destination kept failing",
            deliver_for.as_secs()
        );
        let expired = in_batches(EXPIRE_BATCH, |limit| {
            self.outbox.change(Change::Expire {
                destination,
                scope,
                older_than_ms: millis(deliver_for),
                reason: &reason,
                limit,
            })
        })
        .await;
        match expired {
            Ok(0) => {}
            Ok(expired) => {
                tracing::warn!(%destination, %scope, expired, "deliveries past their window dead-lettered");
                metrics::counter!(
                    "justonce_deliveries_total",
                    "outcome" => "dead",
                    "destination" => destination.clone()
                )
                .increment(expired);
            }
            Err(error) => {
                tracing::warn!(%destination, %scope, %error, "dead-lettering expired deliveries failed");
            }
        }
    }

    /// Hands `row`, with its stored `headers`, to its destination, under the delivery's
    /// span: the trace context sent is the span's own when it is exported, else the stored
    /// one unchanged. Says what became of it and what the receiver answered.
    async fn deliver(
        &self,
        row: &OutboxRow,
        headers: Result<Vec<(String, String)>, Error>,
    ) -> (Delivered, Answer) {
        // A row for a destination this relay does not know may be for one that a newer
        // configuration adds: retry it rather than dead-letter it at once.
        let Some(route) = self.destinations.get(&row.destination) else {
            let reason = format!(
                "no destination named {:?} is registered with the relay",
                row.destination
            );
            return (
                Delivered::Retry {
                    after: None,
                    reason,
                },
                Answer::default(),
            );
        };
        let mut headers = match headers {
            Ok(headers) => headers,
            Err(error) => {
                let reason = error.to_string();
                return (Delivered::Reject { reason }, Answer::default());
            }
        };
        if let Some(own) = trace::context_to_send(&tracing::Span::current(), None) {
            headers.retain(|(name, _)| !is_trace_header(name));
            let pairs = own.headers();
            headers.extend(pairs.map(|(name, value)| (name.to_owned(), value.to_owned())));
        }
        let delivery = Delivery {
            id: row.id,
            key: &row.key,
            destination: &row.destination,
            payload: &row.payload,
            headers: &headers,
            attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
        };
        route.destination.deliver_answered(delivery).await
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

/// The histogram of the seconds from a row's commit (or replay) to its delivery, by
/// destination.
pub const DELIVERED_SECONDS: &str = "justonce_delivery_seconds";

/// What becomes of a row whose delivery failed.
#[derive(Clone, Copy)]
enum Failure {
    Retry { after_ms: i64 },
    Dead,
}

/// Rows dead-lettered per statement when a breaker opens.
const EXPIRE_BATCH: u32 = 1_000;

/// The reason kept when the database refused the real one.
const UNRECORDED_REASON: &str = "the delivery failed; its reason could not be stored";

/// The longest reason kept, in bytes.
const REASON_BYTES: usize = 1_024;

/// The longest start of an answer kept in a row's history, in bytes.
const ANSWER_BYTES: usize = 512;

/// `text` as text every database stores: control characters but newlines and tabs (NUL
/// among them, which PostgreSQL's `text` refuses) replaced by U+FFFD, at most `limit`
/// bytes long. A target's answer is anyone's bytes.
fn safe_text(text: &str, limit: usize) -> String {
    let mut safe = String::with_capacity(text.len().min(limit));
    for c in text.chars() {
        let c = if c.is_control() && c != '\n' && c != '\t' {
            char::REPLACEMENT_CHARACTER
        } else {
            c
        };
        if safe.len() + c.len_utf8() > limit {
            break;
        }
        safe.push(c);
    }
    safe
}

/// What was recorded for one delivered row.
#[derive(Clone, Copy)]
enum Recorded {
    Sent,
    Retried,
    Dead,
    /// Nothing: the row was replayed, dead-lettered or taken over while it was sent.
    Superseded,
}

/// One delivered row: what was recorded, and whether its destination failed to take it.
struct Settled {
    recorded: Recorded,
    unwell: bool,
}

/// A lane: a destination and a scope (empty for rows without one).
type LaneId = (String, String);

/// A breaker that opened: its lane, its pause, the failures in a row, and the rows taken
/// for it that were waiting, with their lease tokens.
struct Opened {
    lane: LaneId,
    pause: Duration,
    failures: u32,
    untried: Vec<(OutboxRow, i64)>,
}

/// A breaker that moved, for [`Relay::record_breaker`].
enum BreakerMoved {
    Opened(Opened),
    Closed(LaneId),
}

/// Rows taken under one lease token.
struct Taken {
    rows: Vec<OutboxRow>,
    token: i64,
    at: Instant,
}

impl RelayRound {
    /// Counts one delivered row, here and in the metrics.
    fn count(&mut self, destination: &str, recorded: Recorded) {
        match recorded {
            Recorded::Sent => self.sent += 1,
            Recorded::Retried => self.retried += 1,
            Recorded::Dead => self.dead += 1,
            Recorded::Superseded => {}
        }
        count_delivery(destination, recorded);
    }
}

/// Counts one delivered row in the metrics.
fn count_delivery(destination: &str, recorded: Recorded) {
    let outcome = match recorded {
        Recorded::Sent => "sent",
        Recorded::Retried => "retried",
        Recorded::Dead => "dead",
        Recorded::Superseded => "superseded",
    };
    metrics::counter!(
        "justonce_deliveries_total",
        "outcome" => outcome,
        "destination" => destination.to_owned()
    )
    .increment(1);
}

/// Each lane's deliveries, in flight and taken but waiting for room, and its breaker,
/// while [`Relay::run`] runs; with each destination's deliveries in flight over its lanes.
#[derive(Default)]
struct Lanes {
    lanes: BTreeMap<LaneId, Lane>,
    in_flight: HashMap<String, usize>,
    /// The lane that started a delivery last: the next one to start is the next lane
    /// after it with a row ready, so that lanes take turns.
    last: Option<LaneId>,
}

#[derive(Default)]
struct Lane {
    in_flight: usize,
    /// Rows taken for this lane, with their lease token and when they were taken.
    waiting: VecDeque<(OutboxRow, i64, Instant)>,
    failures: u32,
    breaker: Breaker,
}

impl Lane {
    /// Deliveries this lane may have in flight now.
    fn cap(&self, options: &RelayOptions) -> usize {
        match self.breaker {
            Breaker::Closed => options.per_destination.max(1),
            Breaker::Probing { .. } => 1,
            Breaker::Open { .. } => 0,
        }
    }

    /// Holds nothing worth keeping: no delivery, no row, no failure, no pause.
    fn idle(&self) -> bool {
        self.in_flight == 0
            && self.waiting.is_empty()
            && self.failures == 0
            && matches!(self.breaker, Breaker::Closed)
    }
}

/// A lane's breaker: closed, open until a time, or letting one probe through.
#[derive(Default, Clone, Copy)]
enum Breaker {
    #[default]
    Closed,
    Open {
        until: Instant,
        pause: Duration,
    },
    Probing {
        pause: Duration,
    },
}

/// Deliveries one destination may have in flight over all its lanes.
fn destination_cap(options: &RelayOptions) -> usize {
    options
        .per_destination_total
        .max(options.per_destination)
        .max(1)
}

impl Lanes {
    /// The lanes the next take leaves out, as JSON for [`Which::Due`]: those with rows
    /// waiting, at their cap, or backed off, as `[destination, scope]`; and every lane of a
    /// destination at its cap, as `[destination]`. A breaker whose pause has ended lets one
    /// probe through from now. Lanes that hold nothing are forgotten.
    fn held_back(&mut self, options: &RelayOptions, now: Instant) -> String {
        self.lanes.retain(|_, lane| !lane.idle());
        let mut held_back = Vec::new();
        for ((destination, scope), lane) in &mut self.lanes {
            if let Breaker::Open { until, pause } = lane.breaker
                && until <= now
            {
                tracing::info!(%destination, %scope, "the breaker lets one delivery through");
                lane.breaker = Breaker::Probing { pause };
            }
            if !lane.waiting.is_empty() || lane.in_flight >= lane.cap(options) {
                held_back.push(serde_json::json!([destination, scope]));
            }
        }
        let cap = destination_cap(options);
        for (destination, in_flight) in &self.in_flight {
            if *in_flight >= cap {
                held_back.push(serde_json::json!([destination]));
            }
        }
        serde_json::Value::from(held_back).to_string()
    }

    fn queue(&mut self, taken: Taken) {
        for row in taken.rows {
            let id = (row.destination.clone(), row.scope.clone());
            let lane = self.lanes.entry(id).or_default();
            lane.waiting.push_back((row, taken.token, taken.at));
        }
    }

    /// A waiting row of the next lane, after the last one served, that has room and whose
    /// destination has room; counted as in flight.
    fn next_ready(&mut self, options: &RelayOptions) -> Option<(OutboxRow, i64, Instant)> {
        let cap = destination_cap(options);
        let ready = |(id, lane): &(&LaneId, &Lane)| {
            !lane.waiting.is_empty()
                && lane.in_flight < lane.cap(options)
                && self.in_flight.get(&id.0).copied().unwrap_or(0) < cap
        };
        let last = self.last.as_ref();
        let after = self
            .lanes
            .iter()
            .filter(|(id, _)| last.is_none_or(|last| *id > last));
        let before = self
            .lanes
            .iter()
            .filter(|(id, _)| last.is_some_and(|last| *id <= last));
        let id = after.chain(before).find(ready)?.0.clone();
        let lane = self.lanes.get_mut(&id)?;
        lane.in_flight += 1;
        let row = lane.waiting.pop_front();
        *self.in_flight.entry(id.0.clone()).or_default() += 1;
        self.last = Some(id);
        row
    }

    /// Records what became of a delivery in `id`'s lane, and moves its breaker; says so
    /// when the breaker opened or closed, for [`Relay::record_breaker`].
    fn settle(
        &mut self,
        id: &LaneId,
        outcome: Result<Option<Settled>, Error>,
        options: &RelayOptions,
    ) -> Option<BreakerMoved> {
        let (destination, scope) = (id.0.as_str(), id.1.as_str());
        if let Some(in_flight) = self.in_flight.get_mut(destination) {
            *in_flight = in_flight.saturating_sub(1);
            if *in_flight == 0 {
                self.in_flight.remove(destination);
            }
        }
        let lane = self.lanes.entry(id.clone()).or_default();
        lane.in_flight = lane.in_flight.saturating_sub(1);
        let unwell = match outcome {
            Ok(Some(settled)) => settled.unwell,
            Ok(None) => return None,
            Err(error) => {
                tracing::warn!(%error, destination, scope, "recording a delivery failed");
                return None;
            }
        };
        let before = std::mem::discriminant(&lane.breaker);
        let mut moved = None;
        if unwell {
            lane.failures = lane.failures.saturating_add(1);
            let first = options.breaker_pause;
            let pause = match lane.breaker {
                Breaker::Probing { pause } => Some((pause * 2).min(first * 32)),
                Breaker::Closed if lane.failures >= options.breaker_failures.max(1) => Some(first),
                Breaker::Closed | Breaker::Open { .. } => None,
            };
            if let Some(pause) = pause {
                lane.breaker = Breaker::Open {
                    until: Instant::now() + pause,
                    pause,
                };
                let untried: Vec<_> = lane
                    .waiting
                    .drain(..)
                    .map(|(row, token, _)| (row, token))
                    .collect();
                tracing::warn!(
                    destination,
                    scope,
                    failures = lane.failures,
                    pause_ms = pause.as_millis() as u64,
                    untried = untried.len(),
                    "the destination keeps failing: its deliveries wait"
                );
                moved = Some(BreakerMoved::Opened(Opened {
                    lane: id.clone(),
                    pause,
                    failures: lane.failures,
                    untried,
                }));
            }
        } else {
            lane.failures = 0;
            if !matches!(lane.breaker, Breaker::Closed) {
                tracing::info!(destination, scope, "the destination answers again");
                moved = Some(BreakerMoved::Closed(id.clone()));
            }
            lane.breaker = Breaker::Closed;
        }
        if before != std::mem::discriminant(&lane.breaker) {
            let open = !matches!(lane.breaker, Breaker::Closed);
            let mut labels = vec![metrics::Label::new("destination", destination.to_owned())];
            // The tenant is a label where there is one, as in the receiver's counts.
            if !scope.is_empty() {
                labels.push(metrics::Label::new("tenant", scope.to_owned()));
            }
            metrics::gauge!("justonce_destination_open", labels).set(if open { 1.0 } else { 0.0 });
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, scope: &str) -> OutboxRow {
        OutboxRow {
            id,
            scope: scope.to_owned(),
            key: format!("k{id}"),
            destination: "d".to_owned(),
            payload: Vec::new(),
            headers: String::new(),
            attempts: 1,
            last_error: None,
            dead: false,
            sent: false,
            age_ms: 0,
        }
    }

    fn taken(rows: Vec<OutboxRow>) -> Taken {
        Taken {
            rows,
            token: 1,
            at: Instant::now(),
        }
    }

    #[test]
    fn lanes_with_rows_ready_take_turns() {
        let options = RelayOptions::default();
        let mut lanes = Lanes::default();
        lanes.queue(taken(vec![
            row(1, "a"),
            row(2, "a"),
            row(3, "a"),
            row(4, "b"),
        ]));
        lanes.queue(taken(vec![row(5, "b"), row(6, "")]));
        let order: Vec<i64> = std::iter::from_fn(|| lanes.next_ready(&options))
            .map(|(row, _, _)| row.id)
            .collect();
        assert_eq!(order, [6, 1, 4, 2, 5, 3]);
    }

    #[test]
    fn a_lane_at_its_cap_and_a_destination_at_its_cap_are_held_back() {
        let options = RelayOptions::default()
            .per_destination(1)
            .per_destination_total(2);
        let mut lanes = Lanes::default();
        lanes.queue(taken(vec![
            row(1, "a"),
            row(2, "a"),
            row(3, "b"),
            row(4, "c"),
        ]));
        let started: Vec<i64> = std::iter::from_fn(|| lanes.next_ready(&options))
            .map(|(row, _, _)| row.id)
            .collect();
        assert_eq!(started, [1, 3], "one in each lane, two at the destination");
        let held_back = lanes.held_back(&options, Instant::now());
        assert_eq!(held_back, r#"[["d","a"],["d","b"],["d","c"],["d"]]"#);
        let sent = Settled {
            recorded: Recorded::Sent,
            unwell: false,
        };
        let lane = ("d".to_owned(), "b".to_owned());
        assert!(lanes.settle(&lane, Ok(Some(sent)), &options).is_none());
        // Lane b is idle and forgotten; c has a row waiting and the destination room.
        assert_eq!(
            lanes.held_back(&options, Instant::now()),
            r#"[["d","a"],["d","c"]]"#
        );
        assert_eq!(
            lanes.next_ready(&options).map(|(row, _, _)| row.id),
            Some(4)
        );
    }

    #[test]
    fn reasons_are_made_safe_to_store() {
        assert_eq!(
            safe_text("answered 400: a\0b\nc", REASON_BYTES),
            "answered 400: a\u{FFFD}b\nc"
        );
        let long = "é".repeat(1_000);
        let safe = safe_text(&long, REASON_BYTES);
        assert!(safe.len() <= REASON_BYTES && safe.len() > REASON_BYTES - 2);
        assert!(safe.chars().all(|c| c == 'é'));
    }
}
