//! The consumer written once over every broker: a [`Broker`] adapter says how to receive a
//! delivery, what it carries and how to settle it; [`Consumer`] holds the policy (the key,
//! attempts, dead letters, the pause after a database failure, metrics, logs, spans).

use crate::reconnect::{Connection, Link, lost_connection};
use crate::{ConsumerStats, Error, Incoming, KeyFrom, Ran, Tenants};
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use justonce_core::TraceContext;
use justonce_core::trace::{TRACEPARENT, TRACESTATE};
use justonce_sql::{Backend, Inbox, Key, Outcome, Scope, WorkFuture, sqlx};
use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::watch;
use tracing::Instrument;

/// How long [`Deliveries::more`] waits for each further delivery: a batch takes what is
/// there, and costs at most this once nothing more comes.
pub(crate) const BATCH_WAIT: Duration = Duration::from_millis(1);

/// The work a consumer runs for each delivery, in the transaction its key is claimed in:
/// any `Fn(&mut Transaction, &Incoming) -> WorkFuture` that may be shared between tasks.
pub trait Work<DB: Backend, E>:
    for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E> + Sync
{
}

impl<DB: Backend, E, F> Work<DB, E> for F where
    F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>
        + Sync
{
}

/// The work a consumer runs once for a whole batch, in the transaction its keys are claimed
/// in: it gets the messages whose key the batch claimed first, in order (a duplicate or a
/// key reused never reaches it), so that it can write their effects with one statement. A
/// batch of only duplicates does not call it. Any `Fn(&mut Transaction, &[&Incoming]) -> WorkFuture` that may be shared between tasks.
///
/// When it fails, the batch rolls back and each of its messages runs again alone, through
/// the same work with a batch of one: a message that fails every time is retried and
/// dead-lettered by itself, and the others take effect once.
pub trait BatchWork<DB: Backend, E>:
    for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t [&'t Incoming]) -> WorkFuture<'t, (), E>
    + Sync
{
}

impl<DB: Backend, E, F> BatchWork<DB, E> for F where
    F: for<'e, 't> Fn(
            &'t mut sqlx::Transaction<'e, DB>,
            &'t [&'t Incoming],
        ) -> WorkFuture<'t, (), E>
        + Sync
{
}

/// A [`Work`] or a [`BatchWork`] as consumers and readers run it: for the messages a
/// transaction claimed first, all at once.
pub(crate) trait RunWork<DB: Backend, E: Send + 'static>: Sync {
    fn run_uncaught<'e, 't>(
        &'t self,
        tx: &'t mut sqlx::Transaction<'e, DB>,
        firsts: &'t [&'t Incoming],
    ) -> WorkFuture<'t, (), E>;

    /// Runs the work, a panic in it caught as a failed run: the transaction is dropped,
    /// so it rolls back, and the consumer goes on.
    fn run<'e, 't>(
        &'t self,
        tx: &'t mut sqlx::Transaction<'e, DB>,
        firsts: &'t [&'t Incoming],
    ) -> WorkFuture<'t, (), Failed<E>> {
        let mut work = self.run_uncaught(tx, firsts);
        Box::pin(std::future::poll_fn(
            move |cx| match std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx))) {
                Ok(Poll::Ready(done)) => Poll::Ready(done.map_err(Failed::Work)),
                Ok(Poll::Pending) => Poll::Pending,
                Err(panic) => Poll::Ready(Err(Failed::Panicked(panic_message(&*panic)))),
            },
        ))
    }
}

/// Why a work's run did not succeed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failed<E> {
    /// The work returned its error: a source, so that [`Inbox::run`] sees a database error
    /// through it.
    #[error("the work failed")]
    Work(#[source] E),
    /// The work panicked, with this message.
    #[error("the work panicked: {0}")]
    Panicked(String),
    /// The work was not run: the runs started reached the attempts allowed.
    #[error("{0}")]
    Spent(Spent),
}

impl<E> Failed<E> {
    /// What the failure comes to for the delivery's settling.
    pub(crate) fn ran(self) -> Ran<E> {
        match self {
            Failed::Work(error) => Ran::Work(error),
            Failed::Panicked(message) => Ran::Panicked(message),
            Failed::Spent(Spent { attempt, reason }) => Ran::Spent { attempt, reason },
        }
    }
}

/// A delivery not run because the runs of its key already started reached the attempts
/// allowed: the attempt it would have been by the count, and the reason its dead letter
/// carries.
#[derive(Debug, Clone)]
pub(crate) struct Spent {
    attempt: u32,
    reason: String,
}

impl std::fmt::Display for Spent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Records in `inbox` that a run of `incoming` starts, for a delivery that may be a re-run,
/// and says whether it is spent: the runs of its key counted before this one reached
/// `max_attempts`. A run not counted (a consumer's first delivery, or a reader's entry after
/// its commit in the partition) is not taken to have run: a delivery given back, or taken
/// ahead and lost, before it ran costs no attempt. So a message whose work ends its
/// process each time runs at most `max_attempts + 1` times. A database failure is returned
/// before anything is counted, so that a delivery given back while the database is down
/// costs no attempt.
pub(crate) async fn count_run<DB: Backend>(
    inbox: &Inbox<DB>,
    incoming: &Incoming,
    max_attempts: u32,
) -> Result<Option<Spent>, justonce_core::Error> {
    let started = inbox.record_run(&incoming.key).await?;
    if started <= u64::from(max_attempts) {
        return Ok(None);
    }
    let counted = started - 1;
    let attempt = u32::try_from(started)
        .unwrap_or(u32::MAX)
        .max(incoming.attempt);
    Ok(Some(Spent {
        attempt,
        reason: format!(
            "not run: {counted} runs of it counted, {max_attempts} allowed; each ended \
             without committing: it failed, or was lost with a consumer that died under it"
        ),
    }))
}

/// The message a panic was given, when it is text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    (panic.downcast_ref::<&str>().map(|text| (*text).to_owned()))
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a payload that is not text".to_owned())
}

/// A [`Work`], run for each message in turn.
pub(crate) struct EachMessage<'w, F>(pub(crate) &'w F);

impl<DB: Backend, E: Send + 'static, F: Work<DB, E>> RunWork<DB, E> for EachMessage<'_, F> {
    fn run_uncaught<'e, 't>(
        &'t self,
        tx: &'t mut sqlx::Transaction<'e, DB>,
        firsts: &'t [&'t Incoming],
    ) -> WorkFuture<'t, (), E> {
        Box::pin(async move {
            for incoming in firsts {
                (self.0)(tx, incoming).await?;
            }
            Ok(())
        })
    }
}

/// A [`BatchWork`], run once for them all, if there are any.
pub(crate) struct WholeBatch<'w, F>(pub(crate) &'w F);

impl<DB: Backend, E: Send + 'static, F: BatchWork<DB, E>> RunWork<DB, E> for WholeBatch<'_, F> {
    fn run_uncaught<'e, 't>(
        &'t self,
        tx: &'t mut sqlx::Transaction<'e, DB>,
        firsts: &'t [&'t Incoming],
    ) -> WorkFuture<'t, (), E> {
        if firsts.is_empty() {
            return Box::pin(std::future::ready(Ok(())));
        }
        (self.0)(tx, firsts)
    }
}

/// The settings every consumer shares, whatever its broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// Where a delivery's key is.
    pub key_from: KeyFrom,
    /// Where each delivery names its tenant, and the tenants taken; none when every key is
    /// claimed in the inbox's scope.
    pub tenants: Option<Tenants>,
    /// How many times failed work is tried before it is dead-lettered.
    pub max_attempts: u32,
    /// How long the consumer takes nothing after the database failed.
    pub store_pause: Duration,
    /// The longest wait between two attempts to connect again to a broker that went away.
    pub reconnect_max_wait: Duration,
}

impl Default for Policy {
    /// The broker's message id as the key, 5 attempts, a pause of 1 s, waits of at most 5 s
    /// between attempts to connect again.
    fn default() -> Self {
        Self {
            key_from: KeyFrom::MessageId,
            tenants: None,
            max_attempts: 5,
            store_pause: Duration::from_secs(1),
            reconnect_max_wait: Duration::from_secs(5),
        }
    }
}

/// The setters of [`Policy`] on a broker's options, which hold it in a field `policy`.
macro_rules! policy_setters {
    ($(#[$key_doc:meta])*) => {
        $(#[$key_doc])*
        pub fn key_from(mut self, key_from: $crate::KeyFrom) -> Self {
            self.policy.key_from = key_from;
            self
        }

        /// Each message's key claimed in the scope of the tenant it names there, one of
        /// those taken; a message that names none, a blank one or another is dead-lettered
        /// at once.
        pub fn tenants(mut self, tenants: $crate::Tenants) -> Self {
            self.policy.tenants = Some(tenants);
            self
        }

        /// How many times failed work is tried before it is dead-lettered (at least 1).
        pub fn max_attempts(mut self, attempts: u32) -> Self {
            self.policy.max_attempts = attempts.max(1);
            self
        }

        /// How long the consumer takes nothing after the database failed (1 s by
        /// default). The delivery goes back to the broker at once.
        pub fn store_pause(mut self, pause: std::time::Duration) -> Self {
            self.policy.store_pause = pause;
            self
        }

        /// The longest wait between two attempts to connect again after the broker went
        /// away (5 s by default): the first waits 100 ms, each next one twice as long, less
        /// a random share up to half.
        pub fn reconnect_max_wait(mut self, wait: std::time::Duration) -> Self {
            self.policy.reconnect_max_wait = wait;
            self
        }
    };
}
pub(crate) use policy_setters;

/// What a broker's delivery carries, as a consumer reads it.
pub trait Received: Send + Sync {
    /// The broker's own id for the message, the key of [`KeyFrom::MessageId`], or why it
    /// has none.
    fn message_id(&self) -> Result<String, String>;
    /// A header (a property, a field) as text, if present.
    fn header(&self, name: &str) -> Option<String>;
    /// Why [`Received::header`] gives no text for `name`, in the broker's own words: the
    /// reason a dead letter carries.
    fn no_header(&self, name: &str) -> String;
    /// What names the delivery in logs, such as its subject or its entry id.
    fn log_id(&self) -> String;
    /// The message body.
    fn body(&self) -> Vec<u8>;
    /// The content type, if any.
    fn content_type(&self) -> Option<String>;
    /// Which attempt this is, from 1.
    fn attempt(&self) -> u32;
    /// Whether the broker delivered it before, or this is a later attempt: a delivery that
    /// may be a re-run. Its run is counted in the database before it starts, and one whose
    /// runs started reached the policy's `max_attempts` is dead-lettered unrun. A first
    /// delivery costs no write.
    fn redelivered(&self) -> bool {
        self.attempt() > 1
    }
}

/// Why a delivery cannot run: both are dead-lettered at once, with the reason.
#[derive(Debug, Clone)]
pub(crate) enum Unusable {
    /// It has no usable key.
    NoKey(String),
    /// It names no tenant, a blank one or one not taken.
    NoTenant(String),
}

impl Unusable {
    /// The reason a dead letter carries.
    pub(crate) fn reason(self) -> String {
        match self {
            Unusable::NoKey(reason) | Unusable::NoTenant(reason) => reason,
        }
    }

    /// What running the delivery came to.
    pub(crate) fn ran<E>(self) -> Ran<E> {
        match self {
            Unusable::NoKey(reason) => Ran::NoKey(reason),
            Unusable::NoTenant(reason) => Ran::NoTenant(reason),
        }
    }
}

/// The text at `from` in `delivery`, whose body is `body`.
fn text_at(from: &KeyFrom, delivery: &impl Received, body: &[u8]) -> Result<String, String> {
    match from {
        KeyFrom::MessageId => delivery.message_id(),
        KeyFrom::Header(name) => delivery
            .header(name)
            .ok_or_else(|| delivery.no_header(name)),
        KeyFrom::Json(pointer) => crate::json_id(body, pointer),
    }
}

/// How many bytes of a tenant not taken a dead letter's reason shows, escaped.
const SHOWN_TENANT_BYTES: usize = 64;

/// The scope of the tenant `delivery` names, or why it is refused. A name not taken is
/// shown escaped and cut short: it is the sender's, and must not forge a log line.
fn tenant_of(tenants: &Tenants, delivery: &impl Received, body: &[u8]) -> Result<Scope, String> {
    let named =
        text_at(&tenants.from, delivery, body).map_err(|why| format!("no tenant: {why}"))?;
    if named.trim().is_empty() {
        return Err("no tenant: the tenant is blank".to_owned());
    }
    if !tenants.allowed.contains(&named) {
        let shown = crate::truncate(&named, SHOWN_TENANT_BYTES);
        return Err(format!(
            "tenant not allowed: {shown:?} is not one of the tenants this consumer takes"
        ));
    }
    Scope::new(named).map_err(|error| format!("tenant not allowed: {error}"))
}

/// The scope `delivery` is claimed in: the tenant it names under `policy`'s tenants, else
/// `scope`, the inbox's.
pub(crate) fn scope_of(
    policy: &Policy,
    scope: &Scope,
    delivery: &impl Received,
) -> Result<Scope, String> {
    match &policy.tenants {
        None => Ok(scope.clone()),
        // A header needs no copy of the body.
        Some(tenants) if matches!(tenants.from, KeyFrom::Json(_)) => {
            tenant_of(tenants, delivery, &delivery.body())
        }
        Some(tenants) => tenant_of(tenants, delivery, &[]),
    }
}

/// The runs of `batch`, in order, whose messages are all claimed in one scope: one claim
/// statement holds one scope. A delivery that cannot run joins the run it is in.
pub(crate) fn scope_runs<D: Received>(
    policy: &Policy,
    scope: &Scope,
    batch: &[D],
) -> Vec<Range<usize>> {
    if policy.tenants.is_none() {
        return std::iter::once(0..batch.len()).collect();
    }
    let mut runs: Vec<(Range<usize>, Option<Scope>)> = Vec::new();
    for (at, delivery) in batch.iter().enumerate() {
        let scope = scope_of(policy, scope, delivery).ok();
        match runs.last_mut() {
            Some((run, held)) if scope.is_none() || held.is_none() || *held == scope => {
                run.end = at + 1;
                if held.is_none() {
                    *held = scope;
                }
            }
            _ => runs.push((at..at + 1, scope)),
        }
    }
    runs.into_iter().map(|(run, _)| run).collect()
}

/// The parts of `batch` that run apart, in order: the first deliveries together, and the
/// deliveries that may be re-runs apart from them (`true`).
fn reruns_apart<D: Received>(batch: &[D]) -> Vec<(Range<usize>, bool)> {
    let mut parts: Vec<(Range<usize>, bool)> = Vec::new();
    for (at, delivery) in batch.iter().enumerate() {
        let rerun = delivery.redelivered();
        match parts.last_mut() {
            Some((part, reruns)) if *reruns == rerun => part.end = at + 1,
            _ => parts.push((at..at + 1, rerun)),
        }
    }
    parts
}

/// What a delivery's work sees under `policy`, claimed in `scope` unless the delivery names
/// its tenant, or why it cannot run.
pub(crate) fn incoming(
    policy: &Policy,
    scope: &Scope,
    delivery: &impl Received,
) -> Result<Incoming, Unusable> {
    let body = delivery.body();
    let text = text_at(&policy.key_from, delivery, &body).map_err(Unusable::NoKey)?;
    let key = crate::message_key(text).map_err(Unusable::NoKey)?;
    let scope = match &policy.tenants {
        None => scope.clone(),
        Some(tenants) => tenant_of(tenants, delivery, &body).map_err(Unusable::NoTenant)?,
    };
    let trace = delivery.header(TRACEPARENT).and_then(|traceparent| {
        TraceContext::parse(&traceparent, delivery.header(TRACESTATE).as_deref())
    });
    Ok(Incoming {
        key,
        scope,
        body,
        attempt: delivery.attempt(),
        redelivered: delivery.redelivered(),
        content_type: delivery.content_type(),
        trace,
    })
}

/// How a delivery is settled once its work has run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// Done with: processed, a duplicate, or its key reused. Acknowledged.
    Ack,
    /// The work failed on `attempt`: delivered again later, as the next attempt.
    Retry {
        /// The attempt that failed.
        attempt: u32,
    },
    /// Given up on `attempt`: published to the dead letters with `reason`, then
    /// acknowledged.
    DeadLetter {
        /// The last attempt.
        attempt: u32,
        /// Why, for the dead letter's reason header.
        reason: String,
    },
    /// The database failed: back to the broker at once, to be delivered again.
    GiveBack,
}

/// The deliveries of one broker connection, one at a time.
pub trait Receive: Send {
    /// What the broker delivers.
    type Delivery: Received;

    /// The next delivery; `None` once the broker ended the consumer.
    fn next(&mut self) -> impl Future<Output = Result<Option<Self::Delivery>, Error>> + Send;

    /// `first` and the deliveries that follow it, each within a millisecond of the one
    /// before, up to `batch_size` in all.
    fn more(
        &mut self,
        first: Self::Delivery,
        batch_size: usize,
    ) -> impl Future<Output = Result<Vec<Self::Delivery>, Error>> + Send {
        async move {
            let mut batch = vec![first];
            // A wait per delivery, not per batch: a busy process still takes whole bursts,
            // and a millisecond without a delivery ends the batch.
            while batch.len() < batch_size {
                match tokio::time::timeout(BATCH_WAIT, self.next()).await {
                    Ok(next) => match next? {
                        Some(delivery) => batch.push(delivery),
                        None => break,
                    },
                    Err(_) => break,
                }
            }
            Ok(batch)
        }
    }

    /// Stops receiving; deliveries not settled go back to the broker.
    fn stop(self) -> impl Future<Output = Result<(), Error>> + Send
    where
        Self: Sized,
    {
        async { Ok(()) }
    }
}

/// A broker adapter: its connection, how it receives and how it settles. [`Consumer`]
/// holds everything else.
pub trait Broker: Send + Sync {
    /// What the broker delivers.
    type Delivery: Received;
    /// The deliveries of one subscription.
    type Receiver<'b>: Receive<Delivery = Self::Delivery> + 'b
    where
        Self: 'b;

    /// The broker's name in metrics: `amqp`, `nats`, `redis`, `mqtt`.
    const NAME: &'static str;

    /// The consumer's settings.
    fn policy(&self) -> &Policy;

    /// Starts receiving.
    fn receive(&self) -> impl Future<Output = Result<Self::Receiver<'_>, Error>> + Send;

    /// Connects again after the connection was lost (receiving or settling failed with
    /// [`Error::Broker`] or [`Error::Tls`]), with the adapter's own connection code: what
    /// [`Broker::receive`] and [`Broker::settle`] use next is the new connection. The
    /// deliveries of the lost one are not settled: the broker delivers them again. A
    /// client that connects again by itself waits for it.
    fn reconnect(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Settles one delivery.
    fn settle(
        &self,
        delivery: &Self::Delivery,
        settle: Settle,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Acknowledges `deliveries`, in order, adding each one acknowledged to `acked`: on an
    /// error, those acknowledged are counted as settled, and no other.
    fn ack_all(
        &self,
        deliveries: &[&Self::Delivery],
        acked: &mut u64,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        async move {
            for delivery in deliveries {
                self.settle(delivery, Settle::Ack).await?;
                *acked += 1;
            }
            Ok(())
        }
    }

    /// Closes the connection; deliveries not acknowledged go back to the broker. Brokers
    /// that need no goodbye leave this to the drop.
    fn close(&self) -> impl Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Runs `work` while `deliveries` are being worked on: a broker that redelivers what
    /// is not acknowledged in time is told they are in progress.
    fn working<T: Send>(
        &self,
        deliveries: &[&Self::Delivery],
        work: impl Future<Output = T> + Send,
    ) -> impl Future<Output = T> + Send {
        let _ = deliveries;
        work
    }
}

/// A consumer of broker `B` that runs each delivery's work once in effect, in a
/// transaction with its key, and settles the delivery only after the commit.
///
/// After a database failure the delivery (and the rest of its batch) goes back to the
/// broker at once, and the consumer takes nothing for the policy's `store_pause`.
///
/// When the connection to the broker is lost, the consumer connects again by itself, after
/// a growing wait (see [`Link`]); the deliveries it had not settled come again from the
/// broker, and their claimed keys make any whose work committed duplicates.
pub struct Consumer<B: Broker, DB: Backend> {
    broker: B,
    inbox: Inbox<DB>,
    connection: Connection,
    batches_at_once: usize,
}

impl<B: Broker + std::fmt::Debug, DB: Backend> std::fmt::Debug for Consumer<B, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("broker", &self.broker)
            .field("inbox", &self.inbox)
            .field("connection", &self.connection)
            .field("batches_at_once", &self.batches_at_once)
            .finish()
    }
}

/// The deliveries of a [`Consumer`], one at a time, for callers that run and settle them
/// themselves.
pub struct Deliveries<'c, B: Broker + 'c> {
    receiver: B::Receiver<'c>,
}

impl<'c, B: Broker + 'c> Deliveries<'c, B> {
    /// The next delivery; `None` once the broker ended the consumer.
    pub async fn next(&mut self) -> Result<Option<B::Delivery>, Error> {
        self.receiver.next().await
    }

    /// `first` and the deliveries that have arrived after it, up to `batch_size` in all.
    pub async fn more(
        &mut self,
        first: B::Delivery,
        batch_size: usize,
    ) -> Result<Vec<B::Delivery>, Error> {
        self.receiver.more(first, batch_size).await
    }

    /// Stops taking deliveries; those not settled go back to the broker.
    pub async fn stop(self) -> Result<(), Error> {
        self.receiver.stop().await
    }
}

impl<B: Broker, DB: Backend> Consumer<B, DB> {
    /// A consumer of `broker` claiming keys in `inbox`.
    pub fn new(broker: B, inbox: Inbox<DB>) -> Self {
        Self {
            broker,
            inbox,
            connection: Connection::default(),
            batches_at_once: 1,
        }
    }

    /// Lets [`Consumer::run_batched`] and [`Consumer::run_batches`] run up to `batches`
    /// batches at once (at most 1,024), each in its own transaction on its own connection
    /// of the inbox's pool; 1 (the default) runs one after the other. [`Consumer::run`]
    /// then runs that many messages at once, as batches of one.
    ///
    /// More than one overlaps one batch's round trips to the database with another's,
    /// where the database, not the work, is what a consumer waits on. Batches are still
    /// acknowledged in the order they were taken, each after its own commit. But a later
    /// batch may commit before an earlier one, and its work does not see the writes of the
    /// batches running beside it: choose 1 where the order effects commit in matters, or
    /// where a message's work reads what an earlier message wrote. The pool needs a
    /// connection for each batch.
    pub fn batches_at_once(mut self, batches: usize) -> Self {
        self.batches_at_once = batches.clamp(1, 1_024);
        self
    }

    /// The state of the connection to the broker while [`Consumer::run`] runs: each change
    /// between connected and connecting again, with the error that lost it.
    pub fn link(&self) -> watch::Receiver<Link> {
        self.connection.follow()
    }

    /// The broker adapter.
    pub fn broker(&self) -> &B {
        &self.broker
    }

    /// The inbox keys are claimed in.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }

    /// Takes deliveries until `shutdown` resolves or the broker ends the consumer, runs
    /// `work` for each in a transaction with its key, and settles each only after.
    /// Deliveries taken but not settled at shutdown go back to the broker.
    ///
    /// A lost connection does not end it: it connects again, waiting 100 ms, then twice as
    /// long after each failed attempt up to the policy's `reconnect_max_wait`, and goes on.
    /// A shutdown ends the wait at once. A refused setting or a database failure met while
    /// connecting again ends it with that error.
    ///
    /// With a shutdown and work that may move between threads, its future may too: run
    /// each consumer on a task of its own, so that several use every core.
    ///
    /// ```no_run
    /// # async fn example<B: justonce_transport::Broker + 'static>(
    /// #     consumer: justonce_transport::Consumer<B, justonce_sql::sqlx::Postgres>,
    /// # ) {
    /// let consuming = tokio::spawn(async move {
    ///     let shutdown = tokio::signal::ctrl_c();
    ///     consumer
    ///         .run(shutdown, |tx, message| {
    ///             Box::pin(async move {
    ///                 justonce_sql::sqlx::query("INSERT INTO shipments (order_key) VALUES ($1)")
    ///                     .bind(message.key.as_str())
    ///                     .execute(&mut **tx)
    ///                     .await
    ///                     .map(drop)
    ///             })
    ///         })
    ///         .await
    /// });
    /// # let _ = consuming.await;
    /// # }
    /// ```
    pub async fn run<F, E>(&self, shutdown: impl Future, work: F) -> Result<ConsumerStats, Error>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_batched(shutdown, 1, work).await
    }

    /// Like [`Consumer::run`], with the deliveries that have arrived, up to `batch_size`,
    /// claimed with one statement and worked in one transaction, then acknowledged after
    /// its commit; a `batch_size` of 1 is [`Consumer::run`]. If any work in a batch fails,
    /// the batch rolls back and its deliveries are run one by one, so that one failing
    /// message neither loses nor doubles the others.
    ///
    /// A batch's acknowledgements go out while the next batch commits, and the batch after
    /// is gathered meanwhile; batches are settled in order, each after its own commit. Let
    /// the broker send three times `batch_size` ahead (its prefetch), so that the next
    /// batch has arrived when one is done; with [`Consumer::batches_at_once`], two batches
    /// more than those running.
    pub async fn run_batched<F, E>(
        &self,
        shutdown: impl Future,
        batch_size: usize,
        work: F,
    ) -> Result<ConsumerStats, Error>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_with(shutdown, batch_size, &EachMessage(&work))
            .await
    }

    /// Like [`Consumer::run_batched`], with `work` run once per batch: it gets the batch's
    /// first claims, duplicates and keys reused left out, and can write all their effects
    /// with one statement. If it fails, the batch rolls back and each delivery runs again
    /// alone through `work`, with a batch of one, and is retried or dead-lettered by
    /// itself, so that one failing message neither loses nor doubles the others.
    ///
    /// ```no_run
    /// # async fn example<B: justonce_transport::Broker>(
    /// #     consumer: justonce_transport::Consumer<B, justonce_sql::sqlx::Postgres>,
    /// # ) -> Result<(), justonce_transport::Error> {
    /// use justonce_sql::sqlx::{Postgres, QueryBuilder};
    ///
    /// # let shutdown = std::future::pending::<()>();
    /// consumer
    ///     .run_batches(shutdown, 100, |tx, batch| {
    ///         Box::pin(async move {
    ///             // One INSERT for the whole batch: a row per message claimed first.
    ///             let mut insert =
    ///                 QueryBuilder::<Postgres>::new("INSERT INTO shipments (order_key, body) ");
    ///             insert.push_values(batch, |mut row, message| {
    ///                 row.push_bind(message.key.as_str())
    ///                     .push_bind(message.body.as_slice());
    ///             });
    ///             insert.build().execute(&mut **tx).await.map(drop)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_batches<F, E>(
        &self,
        shutdown: impl Future,
        batch_size: usize,
        work: F,
    ) -> Result<ConsumerStats, Error>
    where
        F: BatchWork<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_with(shutdown, batch_size, &WholeBatch(&work))
            .await
    }

    /// The loop of [`Consumer::run_batched`] and [`Consumer::run_batches`].
    async fn run_with<E>(
        &self,
        shutdown: impl Future,
        batch_size: usize,
        work: &impl RunWork<DB, E>,
    ) -> Result<ConsumerStats, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut deliveries = self.deliveries().await?;
        let mut stats = ConsumerStats::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let names = (self.inbox.consumer().as_str(), B::NAME);
        let connect = || async {
            self.broker.reconnect().await?;
            self.deliveries().await
        };
        loop {
            let round = self.consume(&mut deliveries, &mut shutdown, batch_size, work, &mut stats);
            let lost = match round.await {
                Ok(()) => break,
                Err(lost) if lost_connection(&lost) => lost,
                Err(error) => return Err(error),
            };
            let policy = self.broker.policy();
            let again = self.connection.reconnect(lost, policy, names, &mut shutdown, &connect);
            // Nothing to stop after a shutdown while connecting again: the receiver is gone.
            let Some(again) = again.await? else {
                return Ok(stats);
            };
            deliveries = again;
        }
        deliveries.stop().await?;
        Ok(stats)
    }

    /// Takes, runs and settles batches until `shutdown` resolves or the broker ends the
    /// consumer, counting each in `stats`; an error once receiving or settling fails.
    ///
    /// Three sides run at once, in order: one gathers the next batch (see [`gathering`]),
    /// one runs batches' work and commits them (up to `batches_at_once` at a time), one
    /// settles the batches committed before. A batch is settled only after its commit, and
    /// batches are settled in the order they were taken, so that the broker's round trips
    /// for one batch's acknowledgements overlap the database's for the next batch's claim.
    /// After a database failure no batch starts for the policy's `store_pause`; those
    /// running go on. At a shutdown the batches running commit and every batch committed is
    /// settled; those only gathered go back to the broker.
    async fn consume<E>(
        &self,
        deliveries: &mut Deliveries<'_, B>,
        shutdown: &mut (impl Future + Unpin),
        batch_size: usize,
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> Result<(), Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let at_once = self.batches_at_once;
        // Batches taken and not settled: the one settling, those running, and the next,
        // gathered meanwhile.
        let receiver = &mut deliveries.receiver;
        let (gather, mut batches) = gathering(receiver, shutdown, batch_size, at_once + 2);
        let (committed, mut settling) =
            tokio::sync::mpsc::channel::<Judged<B::Delivery>>(at_once + 2);
        let run_batch = |batch: Vec<B::Delivery>, taken| async move {
            let mut stats = ConsumerStats::default();
            let (settles, store_failed) = self.run_batch_with(&batch, work, &mut stats).await;
            let judged = Judged {
                batch,
                settles,
                _taken: taken,
            };
            (judged, stats, store_failed)
        };
        let run = async move {
            let mut running = FuturesOrdered::new();
            // Taking ended: a shutdown, the receiver's end, a failure to receive, or one to
            // settle. The batches running still finish: their runs counted and their
            // commits are not cut short.
            let mut ended = false;
            let mut pause = std::pin::pin!(tokio::time::sleep(Duration::ZERO));
            let mut pausing = false;
            // Polled only until it resolves: then taking has ended.
            let mut stopped = batches.stopped();
            loop {
                if ended && running.is_empty() {
                    break;
                }
                tokio::select! {
                    Some((judged, ran, store_failed)) = running.next() => {
                        *stats += ran;
                        // Settling failed: the batch is left unsettled, and its error ends
                        // the consumer.
                        if committed.send(judged).await.is_err() {
                            ended = true;
                        }
                        if store_failed {
                            let resume = tokio::time::Instant::now() + self.broker.policy().store_pause;
                            pause.as_mut().reset(resume);
                            pausing = true;
                        }
                    }
                    taken = batches.next(), if !ended && !pausing && running.len() < at_once => {
                        match taken {
                            Some((batch, taken)) => running.push_back(run_batch(batch, taken)),
                            None => ended = true,
                        }
                    }
                    () = &mut pause, if pausing => pausing = false,
                    () = &mut stopped, if pausing && !ended => ended = true,
                    () = committed.closed(), if !ended => ended = true,
                }
            }
        };
        let settle = async move {
            while let Some(Judged { batch, settles, .. }) = settling.recv().await {
                self.settle_judged(batch.iter().zip(settles)).await?;
            }
            Ok(())
        };
        let ((), settled, gathered) = tokio::join!(run, settle, gather);
        settled.and(gathered)
    }

    /// Closes the broker connection; deliveries not acknowledged go back to the broker.
    pub async fn close(self) -> Result<(), Error> {
        self.broker.close().await
    }

    /// The deliveries one at a time, for callers that run and settle them themselves.
    pub async fn deliveries(&self) -> Result<Deliveries<'_, B>, Error> {
        Ok(Deliveries {
            receiver: self.broker.receive().await?,
        })
    }

    /// What the work of `delivery` sees, or why it has no usable key or tenant.
    pub fn incoming(&self, delivery: &B::Delivery) -> Result<Incoming, String> {
        self.read(delivery).map_err(Unusable::reason)
    }

    /// What the work of `delivery` sees, or why it cannot run.
    fn read(&self, delivery: &B::Delivery) -> Result<Incoming, Unusable> {
        incoming(self.broker.policy(), self.inbox.scope(), delivery)
    }

    /// Runs the work of one delivery in a transaction with its key (see [`Inbox::run`]).
    pub async fn run_one<F, E>(&self, delivery: &B::Delivery, work: &F) -> Ran<E>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_one_with(delivery, &EachMessage(work), false).await
    }

    /// [`Consumer::run_one`] for either kind of work: a [`BatchWork`] gets a batch of one.
    /// `counted`: the run of a delivery that may be a re-run is counted already.
    async fn run_one_with<E>(
        &self,
        delivery: &B::Delivery,
        work: &impl RunWork<DB, E>,
        counted: bool,
    ) -> Ran<E>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let incoming = match self.read(delivery) {
            Ok(incoming) => incoming,
            Err(unusable) => return unusable.ran(),
        };
        let alone: &[&Incoming] = &[&incoming];
        let inbox = crate::inbox_in(&self.inbox, &incoming.scope);
        let spent = if delivery.redelivered() && !counted {
            let max_attempts = self.broker.policy().max_attempts;
            match count_run(&inbox, &incoming, max_attempts).await {
                Ok(spent) => spent,
                Err(error) => return Ran::Store(error),
            }
        } else {
            None
        };
        // A spent delivery still claims its key: one whose work committed before its
        // consumer died is acknowledged as a duplicate, not dead-lettered.
        let run = std::pin::pin!(inbox.run(&incoming.key, &incoming.body, |tx| match &spent {
            Some(spent) => Box::pin(std::future::ready(Err(Failed::Spent(spent.clone())))),
            None => work.run(tx, alone),
        }));
        // The run's future is large: pinned where it is made, the span and the broker's
        // wrapper hold a pointer to it instead of copying it.
        let run = run.instrument(crate::consume_span(&incoming));
        Ran::of(self.broker.working(&[delivery], run).await)
    }

    /// Claims the keys of `batch` with one statement, runs the work of each first claim in
    /// one transaction, and settles every delivery, in order, after its commit; if any work
    /// fails, rolls back and runs and settles the deliveries one by one. True when the
    /// database failed: the delivery that met it and those after it went back to the
    /// broker, and the caller should pause.
    pub async fn settle_batch<F, E>(
        &self,
        batch: &[B::Delivery],
        work: &F,
        stats: &mut ConsumerStats,
    ) -> Result<bool, Error>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.settle_with(batch, &EachMessage(work), stats).await
    }

    /// [`Consumer::settle_batch`] with `work` run once for the batch's first claims, as
    /// [`Consumer::run_batches`] runs it; if it fails, the deliveries run one by one, each
    /// through `work` with a batch of one.
    pub async fn settle_batch_at_once<F, E>(
        &self,
        batch: &[B::Delivery],
        work: &F,
        stats: &mut ConsumerStats,
    ) -> Result<bool, Error>
    where
        F: BatchWork<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.settle_with(batch, &WholeBatch(work), stats).await
    }

    /// [`Consumer::settle_batch`] for either kind of work.
    async fn settle_with<E>(
        &self,
        batch: &[B::Delivery],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> Result<bool, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let (settles, store_failed) = self.run_batch_with(batch, work, stats).await;
        self.settle_judged(batch.iter().zip(settles)).await?;
        Ok(store_failed)
    }

    /// Runs the work of `batch` as [`Consumer::settle_batch`] does, and says how each of
    /// its deliveries is to be settled, in order, counted in `stats`; true when the
    /// database failed: the delivery that met it and those after it are given back. A
    /// batch of several tenants' messages is claimed in runs of one tenant's, in order.
    async fn run_batch_with<E>(
        &self,
        batch: &[B::Delivery],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> (Vec<Settle>, bool)
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut settles = Vec::with_capacity(batch.len());
        for run in scope_runs(self.broker.policy(), self.inbox.scope(), batch) {
            let (settled, store_failed) = self.run_scope_with(&batch[run], work, stats).await;
            settles.extend(settled);
            if store_failed {
                // Not tried: the database that just failed would fail them too.
                stats.returned += (batch.len() - settles.len()) as u64;
                settles.resize(batch.len(), Settle::GiveBack);
                return (settles, true);
            }
        }
        (settles, false)
    }

    /// [`Consumer::run_batch_with`] for deliveries whose keys are all claimed in one scope.
    /// The first deliveries run together, in order. So do the deliveries that may be
    /// re-runs, with a run of each counted, when none of them has runs counted yet. Once one
    /// has, each runs alone with its own count of runs: one that ends the process is then
    /// given up alone, not with the batch around it. How each delivery tried is to be
    /// settled; true when the database failed, at the last one.
    async fn run_scope_with<E>(
        &self,
        batch: &[B::Delivery],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> (Vec<Settle>, bool)
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut settles = Vec::with_capacity(batch.len());
        for (part, reruns) in reruns_apart(batch) {
            let part = &batch[part];
            let counted = match (part.len(), reruns) {
                (1, _) | (_, false) => false,
                (_, true) => match self.record_first_runs(part).await {
                    Ok(counted) => counted,
                    Err(error) => {
                        settles.push(self.judge(&part[0], Ran::<E>::Store(error), stats));
                        return (settles, true);
                    }
                },
            };
            let together = match part.len() {
                1 => None,
                _ if reruns && !counted => None,
                _ => self.run_together(part, work, stats).await,
            };
            let store_failed = match together {
                Some(settled) => {
                    settles.extend(settled);
                    false
                }
                None => {
                    self.run_each(part, work, stats, &mut settles, counted)
                        .await
                }
            };
            if store_failed {
                // The caller gives back the rest, untried.
                return (settles, true);
            }
        }
        (settles, false)
    }

    /// Counts a run of each delivery of `reruns` with a key when none of them has runs
    /// counted (see [`Inbox::record_first_runs`]); whether it did.
    async fn record_first_runs(
        &self,
        reruns: &[B::Delivery],
    ) -> Result<bool, justonce_core::Error> {
        let read: Vec<Incoming> = reruns
            .iter()
            .filter_map(|delivery| self.read(delivery).ok())
            .collect();
        let Some(first) = read.first() else {
            return Ok(false);
        };
        let keys: Vec<&Key> = read.iter().map(|incoming| &incoming.key).collect();
        crate::inbox_in(&self.inbox, &first.scope)
            .record_first_runs(&keys)
            .await
    }

    /// Claims the keys of `batch` with one statement and runs the work of its first claims
    /// in one transaction; how each delivery is to be settled, in order, or `None` when the
    /// batch failed and its deliveries are to run one by one.
    async fn run_together<E>(
        &self,
        batch: &[B::Delivery],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> Option<Vec<Settle>>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let read: Vec<Result<Incoming, Unusable>> =
            batch.iter().map(|delivery| self.read(delivery)).collect();
        let keyed: Vec<&Incoming> = read.iter().filter_map(|read| read.as_ref().ok()).collect();
        let working: Vec<&B::Delivery> = (batch.iter().zip(&read))
            .filter(|(_, read)| read.is_ok())
            .map(|(delivery, _)| delivery)
            .collect();
        let scope = keyed
            .first()
            .map_or(self.inbox.scope(), |first| &first.scope);
        let inbox = crate::inbox_in(&self.inbox, scope);
        let run = inbox.run_batch_at_once(
            &keyed,
            |incoming| (&incoming.key, incoming.body.as_slice()),
            |tx, firsts| {
                Box::pin(async move {
                    let firsts: Vec<&Incoming> = firsts.into_iter().copied().collect();
                    work.run(tx, &firsts).await
                })
            },
        );
        let outcomes = match self.broker.working(&working, run).await {
            Ok(outcomes) => outcomes,
            Err(error) => {
                tracing::debug!(%error, "a batch failed: running its deliveries one by one");
                return None;
            }
        };
        let mut outcomes = outcomes.into_iter();
        let settles = (batch.iter().zip(read))
            .map(|(delivery, read)| {
                let ran = match read {
                    Err(unusable) => unusable.ran::<E>(),
                    Ok(_) => match outcomes.next() {
                        Some(outcome) => Ran::Outcome(outcome),
                        // The batch answers every keyed delivery. Without an answer the
                        // delivery is given back (on MQTT a copy is published and the
                        // original acknowledged), and delivered again.
                        None => Ran::Store(justonce_core::Error::Config(
                            "the batch did not answer for a delivery".to_owned(),
                        )),
                    },
                };
                self.judge(delivery, ran, stats)
            })
            .collect();
        Some(settles)
    }

    /// Runs the deliveries of `batch` one by one, pushing how each is to be settled onto
    /// `settles`; true when the database failed, at the last one pushed: the rest is not
    /// tried. `counted`: their runs are counted already, as a batch's.
    async fn run_each<E>(
        &self,
        batch: &[B::Delivery],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
        settles: &mut Vec<Settle>,
        counted: bool,
    ) -> bool
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        for delivery in batch {
            let ran = self.run_one_with(delivery, work, counted).await;
            let store_failed = matches!(ran, Ran::Store(_));
            settles.push(self.judge(delivery, ran, stats));
            if store_failed {
                return true;
            }
        }
        false
    }

    /// Acknowledges, retries, dead-letters or gives back the delivery as `ran` says, and
    /// counts it in `stats`.
    pub async fn settle<E: std::fmt::Display>(
        &self,
        delivery: &B::Delivery,
        ran: Ran<E>,
        stats: &mut ConsumerStats,
    ) -> Result<(), Error> {
        let settle = self.judge(delivery, ran, stats);
        self.settle_judged([(delivery, settle)]).await
    }

    /// Settles each delivery in order as judged, the acknowledgements of consecutive ones
    /// together.
    async fn settle_judged<'d>(
        &self,
        settling: impl IntoIterator<Item = (&'d B::Delivery, Settle)>,
    ) -> Result<(), Error>
    where
        B::Delivery: 'd,
    {
        let mut acks: Vec<&B::Delivery> = Vec::new();
        for (delivery, settle) in settling {
            if settle == Settle::Ack {
                acks.push(delivery);
                continue;
            }
            self.ack_counted(&acks).await?;
            acks.clear();
            self.settle_counted(delivery, settle).await?;
        }
        self.ack_counted(&acks).await
    }

    /// Acknowledges `deliveries` and counts those acknowledged as consumed.
    async fn ack_counted(&self, deliveries: &[&B::Delivery]) -> Result<(), Error> {
        let mut acked = 0;
        let result = self.broker.ack_all(deliveries, &mut acked).await;
        crate::count_consumed(&self.inbox, B::NAME, acked);
        result
    }

    /// Settles one delivery and counts it as consumed, whatever the settlement. A dead
    /// letter's count of runs is forgotten once it is settled.
    async fn settle_counted(&self, delivery: &B::Delivery, settle: Settle) -> Result<(), Error> {
        let dead_letter = matches!(settle, Settle::DeadLetter { .. });
        self.broker.settle(delivery, settle).await?;
        crate::count_consumed(&self.inbox, B::NAME, 1);
        if dead_letter && let Ok(incoming) = self.read(delivery) {
            crate::forget_runs(&self.inbox, &incoming, &delivery.log_id()).await;
        }
        Ok(())
    }

    /// The key of `delivery` for a log line, or nothing if it has none; read again only
    /// when the line is logged.
    fn logged_key(&self, delivery: &B::Delivery) -> String {
        self.incoming(delivery)
            .map(|incoming| incoming.key.as_str().to_owned())
            .unwrap_or_default()
    }

    /// How a delivery is settled after `ran`, counted and logged.
    fn judge<E: std::fmt::Display>(
        &self,
        delivery: &B::Delivery,
        ran: Ran<E>,
        stats: &mut ConsumerStats,
    ) -> Settle {
        if matches!(ran, Ran::NoTenant(_)) {
            crate::count_rejected_tenant(&self.inbox, B::NAME);
        }
        judge(
            ran,
            delivery.attempt(),
            self.broker.policy().max_attempts,
            stats,
            || self.logged_key(delivery),
            || delivery.log_id(),
        )
    }
}

/// A batch whose work has run, and how each of its deliveries is settled, in order.
struct Judged<D> {
    batch: Vec<D>,
    settles: Vec<Settle>,
    /// Its share of the batches taken and not settled, given back once it is settled.
    _taken: tokio::sync::OwnedSemaphorePermit,
}

/// A batch, and its share of the batches that may be taken and not settled: dropped once
/// the batch is settled.
pub(crate) type Taken<D> = (Vec<D>, tokio::sync::OwnedSemaphorePermit);

/// The batches [`gathering`] takes, in order, for the side that settles them.
pub(crate) struct Batches<D> {
    taken: tokio::sync::mpsc::Receiver<Taken<D>>,
    stopping: watch::Receiver<bool>,
}

impl<D> Batches<D> {
    /// The next batch; `None` once the gathering ended, and at once after a shutdown or a
    /// receiving error, which leave the batch gathered unsettled.
    pub(crate) async fn next(&mut self) -> Option<Taken<D>> {
        let taken = self.taken.recv().await?;
        (!*self.stopping.borrow()).then_some(taken)
    }

    /// Resolves once a shutdown came or receiving failed; never when the broker ended the
    /// deliveries.
    pub(crate) fn stopped(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut stopping = self.stopping.clone();
        Box::pin(async move {
            if stopping.wait_for(|stopped| *stopped).await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

/// Takes batches of up to `batch_size` from `receiver` into [`Batches`] until `shutdown`
/// resolves, the receiver ends, receiving fails or the [`Batches`] are dropped. It takes
/// a batch only while fewer than `ahead` are taken and not settled: the next batch is
/// gathered while one settles, so that the broker's round trips overlap the
/// database's, and batches are still settled one after the other, in order. The future
/// is the gathering, to run beside the settling (with `join!`); its error is receiving's.
pub(crate) fn gathering<'r, R: Receive + 'r>(
    receiver: &'r mut R,
    shutdown: &'r mut (impl Future + Unpin),
    batch_size: usize,
    ahead: usize,
) -> (
    impl Future<Output = Result<(), Error>> + 'r,
    Batches<R::Delivery>,
) {
    let (sent, taken) = tokio::sync::mpsc::channel(ahead);
    let (stop, stopping) = watch::channel(false);
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(ahead));
    let gather = async move {
        let ended = async {
            loop {
                let permit = tokio::select! {
                    _ = &mut *shutdown => return Ok(false),
                    () = sent.closed() => return Ok(false),
                    permit = permits.clone().acquire_owned() => permit,
                };
                // The semaphore is never closed.
                let Ok(permit) = permit else { return Ok(false) };
                let next = tokio::select! {
                    _ = &mut *shutdown => return Ok(false),
                    () = sent.closed() => return Ok(false),
                    next = receiver.next() => next,
                };
                let Some(first) = next? else { return Ok(true) };
                let batch = receiver.more(first, batch_size).await?;
                // Kafka gives none when the partitions changed while it gathered.
                if !batch.is_empty() {
                    // Never waits: the channel holds as many as there are permits.
                    let _ = sent.send((batch, permit)).await;
                }
            }
        };
        let ended: Result<bool, Error> = ended.await;
        // Anything but the receiver's end leaves the batch gathered unsettled.
        if !matches!(ended, Ok(true)) {
            stop.send_replace(true);
        }
        ended.map(drop)
    };
    (gather, Batches { taken, stopping })
}

/// How a delivery is settled after `ran` on `attempt`, counted in `stats` and logged, the
/// same for consumers and readers; `key` and `id` name it in a log line, read only when one
/// is logged.
pub(crate) fn judge<E: std::fmt::Display>(
    ran: Ran<E>,
    attempt: u32,
    max_attempts: u32,
    stats: &mut ConsumerStats,
    key: impl Fn() -> String,
    id: impl Fn() -> String,
) -> Settle {
    match ran {
        Ran::Outcome(Outcome::Processed(())) => {
            stats.processed += 1;
            Settle::Ack
        }
        Ran::Outcome(Outcome::Duplicate) => {
            stats.duplicates += 1;
            Settle::Ack
        }
        Ran::Outcome(Outcome::KeyReused { .. }) => {
            tracing::warn!(
                key = key(),
                delivery = id(),
                "the same key with another payload: skipped"
            );
            stats.key_reused += 1;
            Settle::Ack
        }
        Ran::NoKey(reason) => {
            tracing::warn!(%reason, delivery = id(), "a delivery without a usable key: dead-lettered");
            stats.dead_lettered += 1;
            Settle::DeadLetter { attempt, reason }
        }
        Ran::NoTenant(reason) => {
            tracing::warn!(%reason, delivery = id(), "a delivery without a tenant taken: dead-lettered");
            stats.dead_lettered += 1;
            Settle::DeadLetter { attempt, reason }
        }
        Ran::Spent { attempt, reason } => {
            tracing::warn!(key = key(), delivery = id(), %reason, "a delivery whose runs were lost with their consumer: dead-lettered");
            stats.dead_lettered += 1;
            Settle::DeadLetter { attempt, reason }
        }
        Ran::Work(error) => failed(&error, attempt, max_attempts, stats, key, id),
        Ran::Panicked(message) => failed(
            &format_args!("the work panicked: {message}"),
            attempt,
            max_attempts,
            stats,
            key,
            id,
        ),
        Ran::Store(error) => {
            tracing::warn!(key = key(), delivery = id(), %error, "database failed: the delivery goes back to the broker");
            stats.returned += 1;
            Settle::GiveBack
        }
    }
}

/// How failed work is settled on `attempt`: retried below `max_attempts`, dead-lettered on
/// it with `error` in the reason.
fn failed(
    error: &dyn std::fmt::Display,
    attempt: u32,
    max_attempts: u32,
    stats: &mut ConsumerStats,
    key: impl Fn() -> String,
    id: impl Fn() -> String,
) -> Settle {
    if attempt < max_attempts {
        tracing::debug!(key = key(), delivery = id(), attempt, %error, "work failed: retrying");
        stats.retried += 1;
        return Settle::Retry { attempt };
    }
    let reason = format!("attempt {attempt}: {error}");
    tracing::warn!(key = key(), delivery = id(), %reason, "work failed for the last time: dead-lettered");
    stats.dead_lettered += 1;
    Settle::DeadLetter { attempt, reason }
}

