//! The reader written once over every broker that hands out entries in order: an
//! [`OrderedBroker`] adapter says where reading starts, where each entry sits and how to
//! dead-letter one; [`Reader`] holds the loop (retries in place, dead letters, the pause
//! after a database failure, metrics, logs).
//!
//! The broker keeps no acknowledgement state for such a reader: the database does. Each
//! entry's position is stored as an offset, per stream and partition, in the same
//! transaction as its work. An entry whose transaction committed is never read again,
//! because the reader starts after the stored offset; an entry whose transaction did not
//! commit is read again. The key is still claimed, because a publisher may have sent the
//! same key twice at two positions.

use crate::consumer::{
    BatchWork, EachMessage, Failed, Receive, Received, RunWork, Settle, Spent, Unusable,
    WholeBatch, Work, count_run, gathering, judge, scope_runs,
};
use crate::reconnect::{Connection, Link, lost_connection};
use crate::{ConsumerStats, Error, Incoming, Policy, Ran};
use futures_util::future::{MaybeDone, maybe_done};
use justonce_sql::{
    Backend, Inbox, Key, Offset, OffsetCommit, OffsetSpan, Outcome, RunError, WorkFuture,
};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, oneshot, watch};
use tracing::Instrument;

/// The partition a stream with one partition keeps its offset in.
#[cfg(any(feature = "nats", feature = "redis"))]
pub(crate) const PARTITION: i32 = 0;

/// How many batches a reader takes before the first of them is done with: two running at
/// once (with [`Reader::batches_at_once`] of 2), and one read meanwhile. A reader has no
/// acknowledgements to wait for: its position commits with the work.
const AHEAD: usize = 3;

/// How long a reader waits without a new entry before it stores the offsets of the
/// duplicates it read last.
const IDLE: Duration = Duration::from_secs(1);

/// Where an entry sits: its stream (or topic), its partition, and its offset there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position<'a> {
    /// The name offsets of the stream are stored under.
    pub stream: &'a str,
    /// The partition; 0 on a stream that has one.
    pub partition: i32,
    /// The entry's offset in the partition.
    pub offset: Offset,
}

/// The offsets a [`Reader`] has stored, for its adapter to start reading after. An adapter
/// whose partitions are assigned while it reads asks again at each assignment.
#[derive(Clone)]
pub struct StoredOffsets {
    inbox: Arc<dyn LoadOffsets>,
}

impl std::fmt::Debug for StoredOffsets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredOffsets").finish_non_exhaustive()
    }
}

impl StoredOffsets {
    /// The offset stored for `partition` of `stream`: the last entry processed or given
    /// up there, if any.
    pub async fn offset(&self, stream: &str, partition: i32) -> Result<Option<Offset>, Error> {
        let stored = self.inbox.load(stream).await.map_err(Error::Store)?;
        Ok(stored
            .into_iter()
            .find(|(stored, _)| *stored == partition)
            .map(|(_, offset)| offset))
    }
}

/// The offsets stored for each partition of a stream.
type Loading<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<(i32, Offset)>, justonce_sql::Error>> + Send + 'a>>;

/// An inbox's stored offsets, whatever its database.
trait LoadOffsets: Send + Sync {
    fn load<'a>(&'a self, stream: &'a str) -> Loading<'a>;
}

impl<DB: Backend> LoadOffsets for Inbox<DB> {
    fn load<'a>(&'a self, stream: &'a str) -> Loading<'a> {
        Box::pin(self.load_offsets(stream))
    }
}

/// A broker adapter that hands out entries in order: where reading starts, where each entry
/// sits, and how to dead-letter one. [`Reader`] holds everything else.
pub trait OrderedBroker: Send + Sync {
    /// What the broker hands out.
    type Entry: Received;
    /// The entries, in order.
    type Entries<'b>: Receive<Delivery = Self::Entry> + 'b
    where
        Self: 'b;

    /// The broker's name in metrics: `nats`, `redis`.
    const NAME: &'static str;

    /// The reader's settings.
    fn policy(&self) -> &Policy;

    /// Starts reading each partition after its offset in `stored`, or at its start when
    /// none is stored.
    fn read(
        &self,
        stored: StoredOffsets,
    ) -> impl Future<Output = Result<Self::Entries<'_>, Error>> + Send;

    /// Whether `entry`, read earlier, may still run here: not once the broker took its
    /// partition back (Kafka's rebalance, which comes while the next batch is read), since
    /// the partition's next reader reads it again from the stored offset. Always, where
    /// nothing is taken back.
    fn holds(&self, _entry: &Self::Entry) -> bool {
        true
    }

    /// How many times partitions were assigned to this reader (Kafka's rebalances): a
    /// partition assigned anew starts at an entry its previous reader may have died on.
    /// Always 0 where nothing is assigned.
    fn assignments(&self) -> u64 {
        0
    }

    /// Where `entry` sits, or why it has no position.
    fn position<'e>(&'e self, entry: &'e Self::Entry) -> Result<Position<'e>, String>;

    /// Connects again after the connection was lost (reading or dead-lettering failed with
    /// [`Error::Broker`] or [`Error::Tls`]), with the adapter's own connection code: the
    /// next [`OrderedBroker::read`] reads through the new connection. A client that
    /// connects again by itself waits for it.
    fn reconnect(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Publishes `entry` to the dead letters with the attempt it was given up on and why,
    /// and waits for the broker to store it.
    fn dead_letter(
        &self,
        entry: &Self::Entry,
        attempt: u32,
        reason: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A single reader of broker `O` that runs each entry's work once in effect, in a
/// transaction with its key and its offset, and starts after the stored offsets.
///
/// Failed work runs again in place after a growing delay, holding up the entries after it,
/// up to the attempt limit; then the entry is dead-lettered with its reason and the offset
/// moves past it. After a database failure the reader takes nothing for the policy's
/// `store_pause`, then runs the same entry again.
///
/// When the connection to the broker is lost, the reader connects again by itself, as a
/// [`Consumer`](crate::Consumer) does, and reads again after the stored offsets.
///
/// An entry read after its partition was assigned (or after the reader started), before
/// the reader's first commit there, may be the one its previous reader died on: its run is
/// counted in the database before it starts, and once the runs started reach the policy's
/// `max_attempts` it is dead-lettered unrun. So is each retry in place. Such entries of one
/// batch run together, their runs counted in one statement, when none of them has runs
/// counted; else each alone.
#[derive(Debug)]
pub struct Reader<O: OrderedBroker, DB: Backend> {
    broker: O,
    inbox: Inbox<DB>,
    connection: Connection,
    proven: std::sync::Mutex<Proven>,
    store_failed: std::sync::Mutex<Option<StoreFailed>>,
    /// The entries whose first runs were counted together last: run again after a
    /// database failure, they are not counted again.
    counted: std::sync::Mutex<Vec<Place>>,
    /// The entries of the last batch that may be re-runs, as read before any of it ran:
    /// the rest of the batch that runs again after a database failure still may be, though
    /// entries before it committed. As `counted`, it holds one batch: the reader runs its
    /// batches in turn, and callers of [`Reader::run_batch`] one at a time.
    may_rerun: std::sync::Mutex<Vec<Place>>,
    /// 1, or 2 to run a second batch beside the first.
    batches_at_once: usize,
}

/// Where an entry sits, owned: its stream, its partition, its offset.
type Place = (String, i32, Offset);

/// Whether the first try of an entry counts a run before it starts. Each retry does.
#[derive(Debug, Clone, Copy)]
enum FirstTry {
    /// Read after this reader's commit in the partition: not a re-run.
    Proven,
    /// It may be a re-run: counted alone.
    Count,
    /// It may be a re-run, and its run is counted already, with its batch's.
    Counted,
}

/// The entry whose last run met a database failure, on its attempt, with what its count of
/// runs said: the same attempt after the pause is not counted again, since it did not run.
#[derive(Debug)]
struct StoreFailed {
    entry: (String, i32, Offset, u32),
    spent: Option<Spent>,
}

/// The partitions where this reader committed since they were assigned: an entry read
/// there is not one a previous reader died on.
#[derive(Debug, Default)]
struct Proven {
    /// The broker's [`OrderedBroker::assignments`] when the partitions were noted.
    assignments: u64,
    partitions: BTreeSet<(String, i32)>,
}

/// The entries of a [`Reader`], one at a time, in order, for callers that run them
/// themselves.
pub struct ReaderDeliveries<'r, O: OrderedBroker + 'r> {
    entries: O::Entries<'r>,
}

impl<'r, O: OrderedBroker + 'r> ReaderDeliveries<'r, O> {
    /// The next entry; `None` once the broker ended the stream.
    pub async fn next(&mut self) -> Result<Option<O::Entry>, Error> {
        self.entries.next().await
    }

    /// `first` and the entries that have arrived after it, up to `batch_size` in all; none
    /// when the broker took back a partition they came from (Kafka's rebalance), since the
    /// partition's next reader reads them again.
    pub async fn more(
        &mut self,
        first: O::Entry,
        batch_size: usize,
    ) -> Result<Vec<O::Entry>, Error> {
        self.entries.more(first, batch_size).await
    }

    /// Stops reading. Nothing is settled with the broker: what was not stored is read
    /// again by the next reader.
    pub async fn stop(self) -> Result<(), Error> {
        self.entries.stop().await
    }
}

impl<O: OrderedBroker, DB: Backend> Reader<O, DB> {
    /// A reader of `broker` claiming keys and storing offsets in `inbox`.
    pub fn new(broker: O, inbox: Inbox<DB>) -> Self {
        Self::reporting(broker, inbox, Connection::default())
    }

    /// A reader whose link is `connection`, which the adapter's client reports to as well.
    pub(crate) fn reporting(broker: O, inbox: Inbox<DB>, connection: Connection) -> Self {
        Self {
            broker,
            inbox,
            connection,
            proven: std::sync::Mutex::default(),
            store_failed: std::sync::Mutex::default(),
            counted: std::sync::Mutex::default(),
            may_rerun: std::sync::Mutex::default(),
            batches_at_once: 1,
        }
    }

    /// Lets [`Reader::run_batched`] and [`Reader::run_batches`] run two batches at once
    /// (`batches` of 2 or more); 1, the default, runs one after the other.
    ///
    /// The second batch claims its keys and runs its work beside the first, each in its own
    /// transaction on its own connection of the inbox's pool. Its offsets move only after
    /// the first commits, and if the first rolls back, so does the second: each partition
    /// still commits in order. But the second's work runs before the first commits, so it
    /// does not see the first's writes. Choose 2 only where an entry's work does not read
    /// what an earlier entry of its partition wrote.
    pub fn batches_at_once(mut self, batches: usize) -> Self {
        self.batches_at_once = batches.clamp(1, 2);
        self
    }

    /// Whether the entry at `at`, on its first try, may be a re-run: read before this
    /// reader's first commit in its partition since it was assigned.
    fn may_rerun(&self, at: Position<'_>) -> bool {
        let mut proven = crate::lock(&self.proven);
        let assignments = self.broker.assignments();
        if proven.assignments != assignments {
            *proven = Proven {
                assignments,
                partitions: BTreeSet::new(),
            };
        }
        !(proven.partitions).contains(&(at.stream.to_owned(), at.partition))
    }

    /// Notes a commit of this reader that stored an offset in `partition` of `stream`.
    fn prove(&self, stream: &str, partition: i32) {
        let mut proven = crate::lock(&self.proven);
        proven.partitions.insert((stream.to_owned(), partition));
    }

    /// Counts the run of `incoming` at `at` if it may be a re-run, runs it, and notes a
    /// database failure (see [`count_run`] and [`Reader::run_at`]).
    async fn count_and_run<E>(
        &self,
        at: Position<'_>,
        incoming: &Incoming,
        work: &impl RunWork<DB, E>,
        first_try: FirstTry,
    ) -> Ran<E>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let entry = (
            at.stream.to_owned(),
            at.partition,
            at.offset,
            incoming.attempt,
        );
        let spent = match self.count(incoming, &entry, first_try).await {
            Ok(spent) => spent,
            Err(error) => return Ran::Store(error),
        };
        let ran = self.run_at(at, incoming, spent.as_ref(), work).await;
        *crate::lock(&self.store_failed) =
            matches!(ran, Ran::Store(_)).then_some(StoreFailed { entry, spent });
        ran
    }

    /// Counts the run of `incoming` if it may be a re-run and is not counted yet, and says
    /// whether it is spent (see [`count_run`]). The same attempt of an entry that met a
    /// database failure is not counted twice.
    async fn count(
        &self,
        incoming: &Incoming,
        entry: &(String, i32, Offset, u32),
        first_try: FirstTry,
    ) -> Result<Option<Spent>, justonce_sql::Error> {
        if incoming.attempt == 1 && !matches!(first_try, FirstTry::Count) {
            return Ok(None);
        }
        if let Some(failed) = crate::lock(&self.store_failed).as_ref()
            && failed.entry == *entry
        {
            return Ok(failed.spent.clone());
        }
        let inbox = crate::inbox_in(&self.inbox, &incoming.scope);
        count_run(&inbox, incoming, self.broker.policy().max_attempts).await
    }

    /// The state of the connection to the broker while [`Reader::run`] runs: each change
    /// between connected and connecting again, with the error that lost it.
    pub fn link(&self) -> watch::Receiver<Link> {
        self.connection.follow()
    }

    /// The broker adapter.
    pub fn broker(&self) -> &O {
        &self.broker
    }

    /// The inbox keys are claimed and offsets stored in.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }

    /// Reads entries after the stored offsets until `shutdown` resolves or the broker ends
    /// the stream, and runs `work` for each in a transaction with its key and its offset.
    /// An entry whose transaction had not committed at shutdown is read again by the next
    /// reader. A lost connection does not end it: it connects again as
    /// [`Consumer::run`](crate::Consumer::run) does, and reads on after the stored offsets.
    ///
    /// Its future may run on a task of its own, as a consumer's may:
    ///
    /// ```no_run
    /// # async fn example<O: justonce_transport::OrderedBroker + 'static>(
    /// #     reader: justonce_transport::Reader<O, justonce_sql::sqlx::Postgres>,
    /// # ) {
    /// let reading = tokio::spawn(async move {
    ///     let shutdown = tokio::signal::ctrl_c();
    ///     reader
    ///         .run(shutdown, |tx, entry| {
    ///             Box::pin(async move {
    ///                 justonce_sql::sqlx::query("INSERT INTO shipments (order_key) VALUES ($1)")
    ///                     .bind(entry.key.as_str())
    ///                     .execute(&mut **tx)
    ///                     .await
    ///                     .map(drop)
    ///             })
    ///         })
    ///         .await
    /// });
    /// # let _ = reading.await;
    /// # }
    /// ```
    pub async fn run<F, E>(&self, shutdown: impl Future, work: F) -> Result<ConsumerStats, Error>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_batched(shutdown, 1, work).await
    }

    /// Like [`Reader::run`], with the entries that have arrived, up to `batch_size`, run in
    /// one transaction: their keys claimed with one statement, the work of each first claim,
    /// and the offset of each partition's last entry in the batch; a `batch_size` of 1 is
    /// [`Reader::run`]. If any work or the database fails, the batch rolls back and its
    /// entries run one by one, with their retries in place and dead letters, so that one
    /// failing entry neither loses nor doubles the others and each partition stays in
    /// order. A batch never holds an entry of a partition the broker took back.
    ///
    /// With [`Reader::batches_at_once`] of 2, once its partitions have a commit of this
    /// reader, it runs two batches at once: the second claims its keys and runs its work
    /// beside the first, and moves its offsets only from where the first left them (see
    /// [`Inbox::run_batch_after`]). If the first did not commit, neither does the second:
    /// both run again, in order.
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

    /// Like [`Reader::run_batched`], with `work` run once per batch, before the offsets are
    /// stored: it gets the batch's first claims, duplicates and keys reused left out, and
    /// can write all their effects with one statement. If it fails, the batch rolls back
    /// and each entry runs again alone through `work`, with a batch of one, retried in
    /// place and dead-lettered by itself, so that one failing entry neither loses nor
    /// doubles the others. See [`Consumer::run_batches`](crate::Consumer::run_batches).
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

    /// The loop of [`Reader::run_batched`] and [`Reader::run_batches`].
    async fn run_with<E>(
        &self,
        shutdown: impl Future,
        batch_size: usize,
        work: &impl RunWork<DB, E>,
    ) -> Result<ConsumerStats, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut entries = self.deliveries().await?;
        let mut stats = ConsumerStats::default();
        let mut unstored = Unstored::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let names = (self.inbox.consumer().as_str(), O::NAME);
        let connect = || async {
            self.broker.reconnect().await?;
            self.deliveries().await
        };
        loop {
            let read = self.read_on(
                &mut entries,
                &mut shutdown,
                batch_size,
                work,
                &mut stats,
                &mut unstored,
            );
            let lost = match read.await {
                Ok(()) => break,
                Err(lost) if lost_connection(&lost) => lost,
                Err(error) => return Err(error),
            };
            // The new read starts after the stored offsets: those of the duplicates read
            // last too, so that they are not read again.
            unstored.store(&self.inbox).await;
            let policy = self.broker.policy();
            let again = self
                .connection
                .reconnect(lost, policy, names, &mut shutdown, &connect);
            let Some(again) = again.await? else {
                return Ok(stats);
            };
            entries = again;
        }
        unstored.store(&self.inbox).await;
        entries.stop().await?;
        Ok(stats)
    }

    /// Reads and processes entries, up to `batch_size` at a time, until `shutdown` resolves
    /// or the broker ends the stream; an error once reading or dead-lettering fails. The
    /// next batch is read while one runs (see [`gathering`]); the entries of a partition
    /// taken back meanwhile do not run ([`OrderedBroker::holds`]).
    async fn read_on<E>(
        &self,
        entries: &mut ReaderDeliveries<'_, O>,
        shutdown: &mut (impl Future + Unpin),
        batch_size: usize,
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
        unstored: &mut Unstored,
    ) -> Result<(), Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let (gather, mut batches) = gathering(&mut entries.entries, shutdown, batch_size, AHEAD);
        let process = async move {
            // Each time it resolves, processing returns.
            let mut stopped = batches.stopped();
            let mut on = ReadLoop {
                work,
                stats,
                unstored,
                stopped: &mut stopped,
            };
            // The first batch of two at once, running while the second is taken.
            let mut leading = None;
            loop {
                // The next batch first, to start it beside the one running.
                let taken = tokio::select! {
                    biased;
                    taken = batches.next() => taken,
                    () = ended(&mut leading) => {
                        if self.finish(leading.take(), &mut on).await? {
                            return Ok(());
                        }
                        continue;
                    }
                    () = tokio::time::sleep(IDLE), if on.unstored.is_some() => {
                        on.unstored.store(&self.inbox).await;
                        continue;
                    }
                };
                let Some((mut batch, running)) = taken else {
                    self.finish(leading, &mut on).await?;
                    return Ok(());
                };
                // Read ahead: the partition may have moved since.
                batch.retain(|entry| self.broker.holds(entry));
                let mut before = match leading.take() {
                    Some(before) if self.batches_at_once > 1 && self.all_proven(&batch) => before,
                    other => {
                        // The batch before may prove the partitions: then this one runs
                        // first of the next two.
                        if self.finish(other, &mut on).await? {
                            return Ok(());
                        }
                        if self.all_proven(&batch) {
                            leading = Some(self.start(batch, running, on.work, None));
                        } else if self.in_turn(batch, true, &mut on).await? {
                            return Ok(());
                        }
                        continue;
                    }
                };
                // Started once the batch before has claimed its keys and moved its offsets:
                // then this one waits for it only in the database, which sees any deadlock.
                let ended_first = tokio::select! {
                    biased;
                    () = Pin::new(&mut before.run) => true,
                    claimed = &mut before.claimed => claimed.is_err(),
                };
                if ended_first {
                    if self.finish(Some(before), &mut on).await? {
                        return Ok(());
                    }
                    leading = Some(self.start(batch, running, on.work, None));
                    continue;
                }
                let mut after = self.start(batch, running, on.work, Some(&before.spans));
                // The batch before ends first: this one's offsets wait for its commit.
                let first = end_beside(&mut before, Some(&mut after)).await;
                let second = end_beside(&mut after, None).await;
                // The batch after moves its offsets from where the one before left them: it
                // did not commit if that one did not, and runs again after it, in order.
                let first_committed = first.2.is_some();
                for (ended, together) in [(first, false), (second, !first_committed)] {
                    if self.after_together(ended, together, &mut on).await? {
                        return Ok(());
                    }
                }
            }
        };
        let (gathered, processed) = tokio::join!(gather, process);
        processed.and(gathered)
    }

    /// Runs `batch`, entries the caller took in order (with [`ReaderDeliveries::more`]), as
    /// [`Reader::run_batched`] does, and counts each in `stats`. Returns how many entries,
    /// from the first, are done with: fewer than all when the database failed on the next,
    /// which the caller runs again, with those after it, after the policy's `store_pause`.
    /// Once it returns, the stored offset of each partition is that of its last entry done
    /// with. Run one batch at a time: the reader remembers what it read of the last one.
    pub async fn run_batch<F, E>(
        &self,
        batch: &[O::Entry],
        work: &F,
        stats: &mut ConsumerStats,
    ) -> Result<usize, Error>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_batch_with(batch, &EachMessage(work), stats).await
    }

    /// [`Reader::run_batch`] with `work` run once for the batch's first claims, as
    /// [`Reader::run_batches`] runs it; if it fails, the entries run one by one, each
    /// through `work` with a batch of one.
    pub async fn run_batch_at_once<F, E>(
        &self,
        batch: &[O::Entry],
        work: &F,
        stats: &mut ConsumerStats,
    ) -> Result<usize, Error>
    where
        F: BatchWork<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_batch_with(batch, &WholeBatch(work), stats).await
    }

    /// [`Reader::run_batch`] for either kind of work.
    async fn run_batch_with<E>(
        &self,
        batch: &[O::Entry],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
    ) -> Result<usize, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut unstored = Unstored::default();
        // Nothing stops the caller's batch halfway: it runs until done or the database fails.
        let mut running = std::pin::pin!(std::future::pending::<()>());
        let run = self.run_entries(batch, work, stats, &mut unstored, &mut running, true);
        let (done, _) = run.await?;
        unstored.store(&self.inbox).await;
        Ok(done)
    }

    /// The entries after the stored offsets, for callers that run them themselves.
    pub async fn deliveries(&self) -> Result<ReaderDeliveries<'_, O>, Error> {
        // A new read starts at the stored offsets, where a run may have ended the last one.
        crate::lock(&self.proven).partitions.clear();
        let stored = StoredOffsets {
            inbox: Arc::new(self.inbox.clone()),
        };
        Ok(ReaderDeliveries {
            entries: self.broker.read(stored).await?,
        })
    }

    /// Runs the work of one entry once, in a transaction with its key and its offset.
    pub async fn run_one<F, E>(&self, entry: &O::Entry, work: &F) -> Ran<E>
    where
        F: Work<DB, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let (position, incoming) = match self.read(entry) {
            Ok(read) => read,
            Err(unusable) => return unusable.ran(),
        };
        let first_try = match self.may_rerun(position) {
            true => FirstTry::Count,
            false => FirstTry::Proven,
        };
        let ran = self
            .count_and_run(position, &incoming, &EachMessage(work), first_try)
            .await;
        // Only a processed entry's transaction stored its offset: after a duplicate,
        // a restarted reader reads from before it again.
        if matches!(ran, Ran::Outcome(Outcome::Processed(()))) {
            self.prove(position.stream, position.partition);
        }
        ran
    }

    /// What the work of `entry` sees, or why it has no usable key or tenant.
    pub fn incoming(&self, entry: &O::Entry) -> Result<Incoming, String> {
        self.incoming_or_why(entry).map_err(Unusable::reason)
    }

    /// What the work of `entry` sees, or why it cannot run.
    fn incoming_or_why(&self, entry: &O::Entry) -> Result<Incoming, Unusable> {
        let policy = self.broker.policy();
        let mut incoming = crate::consumer::incoming(policy, self.inbox.scope(), entry)?;
        // A reader runs an entry again in place: the broker handed it out once.
        (incoming.attempt, incoming.redelivered) = (1, false);
        Ok(incoming)
    }

    /// An entry's position and what its work sees, or why it has neither.
    fn read<'e>(&'e self, entry: &'e O::Entry) -> Result<(Position<'e>, Incoming), Unusable> {
        let position = self.broker.position(entry).map_err(Unusable::NoKey)?;
        Ok((position, self.incoming_or_why(entry)?))
    }

    /// Whether `batch` may run together beside the batch before it: more than one entry,
    /// of one scope, none of them a possible re-run.
    fn all_proven(&self, batch: &[O::Entry]) -> bool {
        if batch.len() < 2 || scope_runs(self.broker.policy(), self.inbox.scope(), batch).len() > 1
        {
            return false;
        }
        let held = crate::lock(&self.may_rerun);
        batch.iter().all(|entry| {
            self.broker.position(entry).is_ok_and(|at| {
                !self.may_rerun(at)
                    && !(held.iter()).any(|(stream, partition, offset)| {
                        (stream.as_str(), *partition, *offset)
                            == (at.stream, at.partition, at.offset)
                    })
            })
        })
    }

    /// Starts the transaction of `batch`, run together, after the batch whose spans are
    /// `before` (see [`Inbox::run_batch_after`]), or first.
    fn start<'s, E>(
        &'s self,
        batch: Vec<O::Entry>,
        running: OwnedSemaphorePermit,
        work: &'s impl RunWork<DB, E>,
        before: Option<&[HeldSpan]>,
    ) -> Running<'s, O::Entry>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let (claimed, claimed_now) = oneshot::channel();
        let positions = batch
            .iter()
            .filter_map(|entry| self.broker.position(entry).ok());
        let held: Vec<HeldSpan> = (spans(positions).iter())
            .map(|span| {
                (
                    span.stream.to_owned(),
                    span.partition,
                    span.first,
                    span.last,
                )
            })
            .collect();
        let before = before.map(<[HeldSpan]>::to_vec);
        let run = async move {
            let ran = (self.commit_together(&batch, work, Some(claimed), before.as_deref())).await;
            (batch, running, ran)
        };
        Running {
            // Boxed: the reader's future would otherwise nest too deep for the compiler's
            // default limit in the caller's crate.
            run: maybe_done(Box::pin(run)),
            claimed: claimed_now,
            spans: held,
        }
    }

    /// Waits for the transaction of `leading` and counts it; if it did not commit, runs
    /// its entries one by one. True once the shutdown came.
    async fn finish<E>(
        &self,
        leading: Option<Running<'_, O::Entry>>,
        on: &mut ReadLoop<'_, impl RunWork<DB, E>, impl Future<Output = ()> + Unpin>,
    ) -> Result<bool, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let Some(mut leading) = leading else {
            return Ok(false);
        };
        let ended = end_beside(&mut leading, None).await;
        (self.after_together(ended, false, on)).await
    }

    /// Counts a batch whose transaction `ended`, run together; if it did not commit, runs it
    /// in turn (together first if `together`). True once the shutdown came.
    async fn after_together<E>(
        &self,
        (batch, _running, ran): BatchEnded<O::Entry>,
        together: bool,
        on: &mut ReadLoop<'_, impl RunWork<DB, E>, impl Future<Output = ()> + Unpin>,
    ) -> Result<bool, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        match ran {
            Some(ran) => {
                self.count_together(&batch, ran, on.stats, on.unstored);
                Ok(false)
            }
            None => (self.in_turn(batch, together, on)).await,
        }
    }

    /// Runs `batch` (together first if `together`), and what remains of it after each
    /// database failure once the pause is over. True once the shutdown came.
    async fn in_turn<E>(
        &self,
        mut batch: Vec<O::Entry>,
        mut together: bool,
        on: &mut ReadLoop<'_, impl RunWork<DB, E>, impl Future<Output = ()> + Unpin>,
    ) -> Result<bool, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        loop {
            // Read ahead, or waiting out a pause: the partition may have moved since.
            batch.retain(|entry| self.broker.holds(entry));
            // Boxed, as a batch's transaction is: see `Reader::start`.
            let run = Box::pin(self.run_entries(
                &batch,
                on.work,
                on.stats,
                on.unstored,
                on.stopped,
                together,
            ));
            let (done, ended) = run.await?;
            batch.drain(..done);
            together = true;
            match ended {
                Processed::Done => return Ok(false),
                Processed::Stopped => return Ok(true),
                Processed::StoreFailed => tokio::select! {
                    () = &mut *on.stopped => return Ok(true),
                    () = tokio::time::sleep(self.broker.policy().store_pause) => {}
                },
            }
        }
    }

    /// Runs `batch` in one transaction, or its entries one by one if that did not commit;
    /// how many entries, from the first, are done with, and how the next one ended (see
    /// [`Reader::run_batch`]).
    async fn run_entries<E>(
        &self,
        batch: &[O::Entry],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
        unstored: &mut Unstored,
        shutdown: &mut (impl Future + Unpin),
        try_together: bool,
    ) -> Result<(usize, Processed), Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let batch_reruns = self.batch_reruns(batch);
        // One claim statement holds one scope: a batch of several tenants' entries runs in
        // runs of one tenant's, in order.
        for run in scope_runs(self.broker.policy(), self.inbox.scope(), batch) {
            let entries = &batch[run.clone()];
            let reruns = &batch_reruns[run.clone()];
            let may_rerun = reruns.contains(&true);
            let counted = match entries.len() > 1 && may_rerun {
                false => false,
                true => match self.record_first_runs(entries, reruns).await {
                    Ok(counted) => counted,
                    Err(error) => {
                        tracing::warn!(%error, "database failed: the batch runs again after the pause");
                        stats.returned += 1;
                        return Ok((run.start, Processed::StoreFailed));
                    }
                },
            };
            // Once one of them has runs counted, each runs alone, with its own count.
            let together = try_together && entries.len() > 1 && (counted || !may_rerun);
            if together && self.run_together(entries, work, stats, unstored).await {
                continue;
            }
            for (done, (entry, &rerun)) in entries.iter().zip(reruns).enumerate() {
                let first_try = match (rerun, counted) {
                    (false, _) => FirstTry::Proven,
                    (true, false) => FirstTry::Count,
                    (true, true) => FirstTry::Counted,
                };
                match self
                    .process(entry, work, stats, unstored, shutdown, first_try)
                    .await?
                {
                    Processed::Done => {}
                    ended => return Ok((run.start + done, ended)),
                }
            }
        }
        Ok((batch.len(), Processed::Done))
    }

    /// Counts a run of each entry of `entries` that may be a re-run (`reruns`) when none of
    /// them has runs counted (see [`Inbox::record_first_runs`]); whether it did, or did
    /// for the same entries before their last database failure.
    async fn record_first_runs(
        &self,
        entries: &[O::Entry],
        reruns: &[bool],
    ) -> Result<bool, justonce_sql::Error> {
        let read: Vec<(Position<'_>, Incoming)> = (entries.iter().zip(reruns))
            .filter(|(_, rerun)| **rerun)
            .filter_map(|(entry, _)| self.read(entry).ok())
            .collect();
        let Some((_, first)) = read.first() else {
            return Ok(false);
        };
        let positions: Vec<Place> = (read.iter())
            .map(|(at, _)| (at.stream.to_owned(), at.partition, at.offset))
            .collect();
        let counted_before = {
            let counted = crate::lock(&self.counted);
            positions.iter().all(|at| counted.contains(at))
        };
        if counted_before {
            return Ok(true);
        }
        let keys: Vec<&justonce_sql::Key> =
            read.iter().map(|(_, incoming)| &incoming.key).collect();
        let inbox = crate::inbox_in(&self.inbox, &first.scope);
        let counted = inbox.record_first_runs(&keys).await?;
        if counted {
            *crate::lock(&self.counted) = positions;
        }
        Ok(counted)
    }

    /// Claims the keys of `batch` with one statement, runs the work of each first claim and
    /// stores the offset of each partition's last entry, in one transaction; false, with
    /// nothing counted, when it did not commit.
    async fn run_together<E>(
        &self,
        batch: &[O::Entry],
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
        unstored: &mut Unstored,
    ) -> bool
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let ran = self.commit_together(batch, work, None, None).await;
        ran.map(|ran| self.count_together(batch, ran, stats, unstored))
            .is_some()
    }

    /// The transaction of [`Reader::run_together`]: what each entry's work saw and what it
    /// came to, once committed. `claimed` hears when the keys are claimed and the offsets
    /// moved, or, after the batch whose spans are `before`, when the keys are claimed.
    async fn commit_together<E>(
        &self,
        batch: &[O::Entry],
        work: &impl RunWork<DB, E>,
        claimed: Option<oneshot::Sender<()>>,
        before: Option<&[HeldSpan]>,
    ) -> Option<Together>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        // An entry without a key is dead-lettered before the offset moves past it: the
        // batch runs one by one.
        let read: Vec<(Position<'_>, Incoming)> = (batch.iter())
            .map(|entry| self.read(entry))
            .collect::<Result<_, _>>()
            .ok()?;
        let spans = spans(read.iter().map(|(position, _)| *position));
        let scope = read
            .first()
            .map_or(self.inbox.scope(), |(_, first)| &first.scope);
        let inbox = crate::inbox_in(&self.inbox, scope);
        let work = batch_work(|tx, firsts: Vec<&(Position<'_>, Incoming)>| {
            Box::pin(async move {
                if let Some(claimed) = claimed {
                    let _ = claimed.send(());
                }
                let firsts: Vec<&Incoming> =
                    firsts.into_iter().map(|(_, incoming)| incoming).collect();
                work.run(tx, &firsts).await
            })
        });
        let run = match before {
            None => {
                inbox
                    .run_batch_at_offsets(&read, claimed_as, &spans, work)
                    .await
            }
            Some(before) => {
                let before: Vec<OffsetSpan<'_>> = (before.iter())
                    .map(|(stream, partition, first, last)| OffsetSpan {
                        stream,
                        partition: *partition,
                        first: *first,
                        last: *last,
                    })
                    .collect();
                (inbox.run_batch_after(&read, claimed_as, &spans, &before, work)).await
            }
        };
        let outcomes = match run {
            Ok(Some(outcomes)) => outcomes,
            // One by one, the entries processed before are found duplicates.
            Ok(None) => {
                tracing::debug!(
                    "a batch's entry was processed before, or the batch before it did not commit: running them one by one"
                );
                return None;
            }
            Err(error) => {
                tracing::debug!(%error, "a batch failed: running its entries one by one");
                return None;
            }
        };
        let incomings = read.into_iter().map(|(_, incoming)| incoming).collect();
        Some(Together {
            incomings,
            outcomes,
        })
    }

    /// Counts a batch that committed together in `stats`, and notes its partitions proven
    /// and their offsets stored.
    fn count_together(
        &self,
        batch: &[O::Entry],
        ran: Together,
        stats: &mut ConsumerStats,
        unstored: &mut Unstored,
    ) {
        crate::count_consumed(&self.inbox, O::NAME, batch.len() as u64);
        let max_attempts = self.broker.policy().max_attempts;
        for ((entry, incoming), outcome) in batch.iter().zip(&ran.incomings).zip(ran.outcomes) {
            let key = || incoming.key.as_str().to_owned();
            judge::<std::convert::Infallible>(
                Ran::Outcome(outcome),
                1,
                max_attempts,
                stats,
                key,
                || entry.log_id(),
            );
        }
        // Every entry of a batch that ran together has a position.
        let positions = batch
            .iter()
            .filter_map(|entry| self.broker.position(entry).ok());
        let spans = spans(positions);
        for span in &spans {
            self.prove(span.stream, span.partition);
        }
        unstored.stored(&spans);
    }

    /// Whether each entry of `batch` may be a re-run, read before any of it runs: a commit
    /// of the first proves nothing of those after it, which the previous reader may have
    /// run with it, and died on. The rest of a batch the database failed in keeps what its
    /// entries were when the batch was first read.
    fn batch_reruns(&self, batch: &[O::Entry]) -> Vec<bool> {
        // An entry without a position is dead-lettered unrun: no run of it to count.
        let read: Vec<Option<(Place, bool)>> = (batch.iter())
            .map(|entry| {
                let at = self.broker.position(entry).ok()?;
                let held = (at.stream.to_owned(), at.partition, at.offset);
                Some((held, self.may_rerun(at)))
            })
            .collect();
        let mut held = crate::lock(&self.may_rerun);
        let reruns: Vec<bool> = (read.iter())
            .map(|read| {
                read.as_ref()
                    .is_some_and(|(at, unproven)| *unproven || held.contains(at))
            })
            .collect();
        *held = (read.into_iter().zip(&reruns))
            .filter_map(|(read, rerun)| read.filter(|_| *rerun).map(|(at, _)| at))
            .collect();
        reruns
    }

    /// Runs an entry's work with its retries, and gives up on it or counts it; `first_try`
    /// says whether its first try counts a run. A shutdown ends the wait before a retry at
    /// once. An entry whose partition was taken back, before
    /// it ran or between two tries, is left to the partition's next reader.
    async fn process<E>(
        &self,
        entry: &O::Entry,
        work: &impl RunWork<DB, E>,
        stats: &mut ConsumerStats,
        unstored: &mut Unstored,
        shutdown: &mut (impl Future + Unpin),
        first_try: FirstTry,
    ) -> Result<Processed, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        if !self.broker.holds(entry) {
            return Ok(Processed::Done);
        }
        crate::count_consumed(&self.inbox, O::NAME, 1);
        let id = || entry.log_id();
        let (position, mut incoming) = match self.read(entry) {
            Ok(read) => read,
            Err(unusable) => {
                let ran = unusable.ran::<E>();
                if matches!(ran, Ran::NoTenant(_)) {
                    crate::count_rejected_tenant(&self.inbox, O::NAME);
                }
                let settle = judge::<E>(ran, 1, 1, stats, String::new, id);
                return self.settle(entry, settle, shutdown).await;
            }
        };
        let key = || incoming.key.as_str().to_owned();
        let max_attempts = self.broker.policy().max_attempts;
        loop {
            let ran = self
                .count_and_run(position, &incoming, work, first_try)
                .await;
            match &ran {
                Ran::Outcome(outcome) => {
                    unstored.after(outcome, position);
                    if matches!(outcome, Outcome::Processed(())) {
                        self.prove(position.stream, position.partition);
                    }
                }
                Ran::Store(error) => {
                    tracing::warn!(key = key(), delivery = id(), %error, "database failed: the entry runs again after the pause");
                    stats.returned += 1;
                    return Ok(Processed::StoreFailed);
                }
                Ran::NoKey(_)
                | Ran::NoTenant(_)
                | Ran::Work(_)
                | Ran::Panicked(_)
                | Ran::Spent { .. } => {}
            }
            let attempt = incoming.attempt;
            match judge(ran, attempt, max_attempts, stats, key, id) {
                // Failed work holds up the entries after it: the price of reading in order.
                Settle::Retry { attempt } => {
                    tokio::select! {
                        _ = &mut *shutdown => return Ok(Processed::Stopped),
                        () = tokio::time::sleep(retry_delay(attempt)) => {}
                    }
                    if !self.broker.holds(entry) {
                        return Ok(Processed::Done);
                    }
                    incoming.attempt += 1;
                    incoming.redelivered = true;
                }
                settle => return self.settle(entry, settle, shutdown).await,
            }
        }
    }

    /// Dead-letters an entry given up and moves the offset past it. A database failure
    /// moving the offset is tried again after each pause, alone: the entry's work is not
    /// run again, and the dead letter is published once. A reader that stops or dies before
    /// the offset moved dead-letters the entry again. So does the partition's next member
    /// when the partition is taken back while the dead letter is published.
    async fn settle(
        &self,
        entry: &O::Entry,
        settle: Settle,
        shutdown: &mut (impl Future + Unpin),
    ) -> Result<Processed, Error> {
        let Settle::DeadLetter { attempt, reason } = settle else {
            return Ok(Processed::Done);
        };
        // Taken back during its last attempt, the entry is the next member's to give up: it
        // reads it again from the stored offset. Dead-lettered here too, it would be twice.
        if !self.broker.holds(entry) {
            return Ok(Processed::Done);
        }
        self.broker.dead_letter(entry, attempt, &reason).await?;
        let Ok(position) = self.broker.position(entry) else {
            return Ok(Processed::Done);
        };
        while let Err(error) = self.skip(position).await {
            tracing::warn!(%error, delivery = entry.log_id(), "database failed: the offset did not move past a dead letter; trying again after the pause");
            tokio::select! {
                _ = &mut *shutdown => return Ok(Processed::Stopped),
                () = tokio::time::sleep(self.broker.policy().store_pause) => {}
            }
        }
        if let Ok((_, incoming)) = self.read(entry) {
            crate::forget_runs(&self.inbox, &incoming, &entry.log_id()).await;
        }
        Ok(Processed::Done)
    }

    /// Runs `work` for `incoming`, at `position`, in one transaction with its key and the
    /// offset (see [`Inbox::run`]). A duplicate key commits nothing, so that a burst of
    /// duplicates costs no writes: the offset moves with the next processed entry or when
    /// the reader is idle ([`Unstored`]), and a reader restarted before then reads those
    /// duplicates again, as duplicates.
    ///
    /// A `spent` entry claims its key and runs nothing: one processed before is a
    /// duplicate, any other is dead-lettered.
    async fn run_at<E>(
        &self,
        at: Position<'_>,
        incoming: &Incoming,
        spent: Option<&Spent>,
        work: &impl RunWork<DB, E>,
    ) -> Ran<E>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let inbox = crate::inbox_in(&self.inbox, &incoming.scope);
        let inbox = &*inbox;
        let alone: &[&Incoming] = &[incoming];
        let run = std::pin::pin!(inbox.run(&incoming.key, &incoming.body, |tx| {
            Box::pin(async move {
                if let Some(spent) = spent {
                    return Err(InOrderError::Work(Failed::Spent(spent.clone())));
                }
                work.run(tx, alone).await.map_err(InOrderError::Work)?;
                match inbox
                    .commit_offset(tx, at.stream, at.partition, at.offset)
                    .await
                    .map_err(InOrderError::Offset)?
                {
                    OffsetCommit::Moved => Ok(()),
                    OffsetCommit::AlreadyProcessed => Err(InOrderError::AlreadyProcessed),
                }
            })
        }));
        // The run's future is large: pinned where it is made, the span holds a pointer to it
        // instead of copying it.
        let run = run.instrument(crate::consume_span(incoming)).await;
        match run {
            Ok(outcome) => Ran::Outcome(outcome),
            Err(RunError::Work(InOrderError::Work(failed))) => failed.ran(),
            Err(RunError::Work(InOrderError::AlreadyProcessed)) => Ran::Outcome(Outcome::Duplicate),
            Err(RunError::Work(InOrderError::Offset(error)) | RunError::Store(error)) => {
                Ran::Store(error)
            }
            Err(error) => Ran::Store(justonce_sql::Error::Config(format!(
                "the run failed in a way this reader does not know: {error}"
            ))),
        }
    }

    /// Moves the offset past an entry given up, in a transaction of its own.
    async fn skip(&self, at: Position<'_>) -> Result<(), justonce_sql::Error> {
        (self.inbox)
            .move_offset(at.stream, at.partition, at.offset)
            .await
            .map(drop)
    }
}

/// A batch's span of a partition, owned: its stream, its partition, its first and last
/// offset.
type HeldSpan = (String, i32, Offset, Offset);

/// What each entry of a batch that committed together saw, and what it came to.
struct Together {
    incomings: Vec<Incoming>,
    outcomes: Vec<Outcome<()>>,
}

/// A batch whose transaction ended: the batch, its place among those taken, and what it
/// came to if it committed.
type BatchEnded<D> = (Vec<D>, OwnedSemaphorePermit, Option<Together>);

/// The transaction of a batch run together.
type BatchRun<'s, D> = Pin<Box<dyn Future<Output = BatchEnded<D>> + Send + 's>>;

/// A batch run together, its transaction running while the reader takes the next batch.
struct Running<'s, D> {
    run: MaybeDone<BatchRun<'s, D>>,
    /// Resolves once its keys are claimed and its offsets moved: the batch after it may
    /// start.
    claimed: oneshot::Receiver<()>,
    /// Its spans, for the batch after it.
    spans: Vec<HeldSpan>,
}

/// What an entry read is claimed as: its key and its body.
fn claimed_as<'r>((_, incoming): &'r (Position<'_>, Incoming)) -> (&'r Key, &'r [u8]) {
    (&incoming.key, &incoming.body)
}

/// Gives `work` the signature a batch's transaction runs it with.
fn batch_work<'env, DB: Backend, M, E, F>(work: F) -> F
where
    F: for<'t> FnOnce(
        &'t mut justonce_sql::sqlx::Transaction<'env, DB>,
        Vec<&'t M>,
    ) -> WorkFuture<'t, (), E>,
{
    work
}

/// What the reader's loop carries from one batch to the next.
struct ReadLoop<'l, W, S> {
    work: &'l W,
    stats: &'l mut ConsumerStats,
    unstored: &'l mut Unstored,
    /// Resolves once processing is to return.
    stopped: &'l mut S,
}

/// Waits for the transaction of `batch` to end, while that of `beside`, if any, runs on.
async fn end_beside<D>(
    batch: &mut Running<'_, D>,
    beside: Option<&mut Running<'_, D>>,
) -> BatchEnded<D> {
    if let Some(beside) = beside {
        futures_util::future::select(Pin::new(&mut batch.run), Pin::new(&mut beside.run)).await;
    }
    Pin::new(&mut batch.run).await;
    // Taken once: each batch run is ended here, once.
    (Pin::new(&mut batch.run).take_output()).expect("a batch run ends once")
}

/// Resolves once the transaction of `leading` ended; never when there is none.
async fn ended<D>(leading: &mut Option<Running<'_, D>>) {
    match leading {
        Some(leading) => Pin::new(&mut leading.run).await,
        None => std::future::pending().await,
    }
}

/// What processing an entry came to.
enum Processed {
    /// Processed, a duplicate, given up with the offset past it, or left to the next
    /// reader of a partition taken back.
    Done,
    /// The database failed: the entry runs again after the pause.
    StoreFailed,
    /// The shutdown came while the entry waited: what was not stored is read again by the
    /// next reader.
    Stopped,
}

/// Why the transaction of an entry read in order did not commit.
#[derive(Debug, thiserror::Error)]
enum InOrderError<E> {
    #[error("the work failed")]
    Work(#[source] Failed<E>),
    /// A reader that died after sending its COMMIT committed this entry after this reader
    /// loaded the offset.
    #[error("the entry was processed before")]
    AlreadyProcessed,
    /// A source, so that [`Inbox::run`] sees a retryable database error through it.
    #[error("storing the offset")]
    Offset(#[source] justonce_sql::Error),
}

/// Each partition's span of a batch's entries: its first and last offset. The batch stores
/// the last if the stored offset is below the first: otherwise a reader before this one
/// moved past an entry of the batch (gave it up) after this one loaded the offsets, as
/// [`Inbox::commit_offset`] says of a single entry.
fn spans<'a>(positions: impl IntoIterator<Item = Position<'a>>) -> Vec<OffsetSpan<'a>> {
    // A batch holds a few partitions: a search of the spans beats a map.
    let mut spans: Vec<OffsetSpan<'a>> = Vec::new();
    for at in positions {
        match (spans.iter_mut())
            .find(|span| (span.stream, span.partition) == (at.stream, at.partition))
        {
            Some(span) => span.last = at.offset,
            None => spans.push(OffsetSpan {
                stream: at.stream,
                partition: at.partition,
                first: at.offset,
                last: at.offset,
            }),
        }
    }
    // In one order for every reader, so that two taking the same rows lock them alike.
    spans.sort_unstable_by_key(|span| (span.stream, span.partition));
    spans
}

/// The offset of the last entry read in each partition, when its transaction did not store
/// it (a duplicate).
#[derive(Debug, Default)]
struct Unstored(BTreeMap<(String, i32), Offset>);

impl Unstored {
    /// Notes what running the entry at `at` came to.
    fn after(&mut self, outcome: &Outcome<()>, at: Position<'_>) {
        let partition = (at.stream.to_owned(), at.partition);
        match outcome {
            Outcome::Processed(()) => self.0.remove(&partition),
            Outcome::Duplicate | Outcome::KeyReused { .. } => self.0.insert(partition, at.offset),
        };
    }

    /// Forgets the partitions of a batch that stored its offsets.
    fn stored(&mut self, spans: &[OffsetSpan<'_>]) {
        for span in spans {
            self.0.remove(&(span.stream.to_owned(), span.partition));
        }
    }

    fn is_some(&self) -> bool {
        !self.0.is_empty()
    }

    /// Stores each offset in a transaction of its own. A failure leaves it for the next
    /// time: until then, a restarted reader reads those duplicates again.
    async fn store<DB: Backend>(&mut self, inbox: &Inbox<DB>) {
        let mut failed = BTreeMap::new();
        for ((stream, partition), offset) in std::mem::take(&mut self.0) {
            if let Err(error) = inbox.move_offset(&stream, partition, offset).await {
                tracing::warn!(%error, "storing the offset of duplicates failed");
                failed.insert((stream, partition), offset);
            }
        }
        self.0 = failed;
    }
}

/// 1 s after the first failure, doubling to at most a minute.
pub(crate) fn retry_delay(attempt: u32) -> Duration {
    Duration::from_secs(1 << attempt.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}
