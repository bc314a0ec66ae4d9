//! The NATS JetStream consumer and publisher against the real server, with the keys on each
//! real database: failures redelivered then dead-lettered, two worker processes on one
//! durable consumer, and the relay's publisher deduplicated by the stream. The proofs every
//! broker shares are in `broker`.

use super::broker::{
    Batching, GivingBack, OneAttempt, TestBroker, consume_until, read_to_end, take,
};
use super::on_every_database;
use async_nats::jetstream::{self, consumer::pull};
use justonce_sql::{Delivered, Delivery, Destination, Inbox, Key, WorkFuture};
use justonce_tests::{TestBackend, TestDb, consumer_work, nats_url};
use justonce_transport::nats::{
    MSG_ID_HEADER, NatsConsumer, NatsDestination, NatsOptions, NatsReader,
};
use justonce_transport::{ConsumerStats, Incoming, KeyFrom, REASON_HEADER};
use std::time::Duration;

on_every_database!(
    failing_work_is_redelivered_then_dead_lettered,
    a_message_without_its_key_header_is_dead_lettered_with_the_reason,
    a_reader_runs_failing_work_again_in_place_then_dead_letters_it_and_moves_on,
    a_readers_work_sees_what_every_entry_before_it_wrote,
    the_relay_publishes_with_its_key_and_the_stream_drops_a_repeat,
);

/// A stream named after the test's prefix (with its subject and durable consumer of the
/// same name), deleted at the end.
pub(crate) struct Stream {
    name: String,
    jetstream: jetstream::Context,
}

impl Stream {
    async fn new<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {}: {e}", nats_url()));
        Self {
            name: format!("{}orders", db.prefix),
            jetstream: jetstream::new(client),
        }
    }

    /// Publishes `body` with the key in the `Order-Id` header (no `Nats-Msg-Id`, so that
    /// the stream keeps repeats) and waits for the stream to store it.
    async fn publish(&self, key: &str, body: &[u8]) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Order-Id", key);
        self.jetstream
            .publish_with_headers(self.name.clone(), headers, body.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages the durable consumer has not yet had acknowledged.
    async fn unsettled(&self) -> u64 {
        let stream = self.jetstream.get_stream(&self.name).await.unwrap();
        let mut consumer: jetstream::consumer::Consumer<pull::Config> =
            stream.get_consumer(&self.name).await.unwrap();
        let info = consumer.info().await.unwrap();
        info.num_pending + info.num_ack_pending as u64
    }

    async fn messages_in(&self, stream: &str) -> u64 {
        let mut stream = self.jetstream.get_stream(stream).await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    async fn delete(self) {
        for name in [format!("{}_DEAD", self.name), self.name.clone()] {
            self.jetstream.delete_stream(&name).await.unwrap();
        }
    }
}

fn options(stream: &Stream) -> NatsOptions {
    NatsOptions::new(&stream.name, &stream.name).key_from(KeyFrom::Header("Order-Id".into()))
}

async fn failing_work_is_redelivered_then_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let consumer = NatsConsumer::connect(
        &nats_url(),
        db.inbox.clone(),
        options(&stream).max_attempts(2),
    )
    .await
    .unwrap();
    stream
        .publish("fail1:order", b"succeeds on the second attempt")
        .await;
    stream.publish("bad:order", b"never succeeds").await;
    let dead = format!("{}_DEAD", stream.name);
    let stats = consume_until(&db, &consumer, || async {
        stream.messages_in(&dead).await == 1 && db.rows("effects").await == 1
    })
    .await;
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1));
    assert_eq!(db.effects_of(&Key::new("fail1:order").unwrap()).await, 1);
    assert_eq!(db.effects_of(&Key::new("bad:order").unwrap()).await, 0);
    let dead_stream = stream.jetstream.get_stream(&dead).await.unwrap();
    let letter = dead_stream.get_raw_message(1).await.unwrap();
    assert_eq!(&letter.payload[..], b"never succeeds");
    let reason = letter
        .headers
        .get(REASON_HEADER)
        .unwrap()
        .as_str()
        .to_owned();
    assert!(reason.contains("refused on attempt 2"), "{reason}");
    stream.delete().await;
    db.cleanup().await;
}

async fn a_message_without_its_key_header_is_dead_lettered_with_the_reason<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let consumer = NatsConsumer::connect(&nats_url(), db.inbox.clone(), options(&stream))
        .await
        .unwrap();
    (stream.jetstream)
        .publish(stream.name.clone(), b"no key".as_slice().into())
        .await
        .unwrap()
        .await
        .unwrap();
    let dead = format!("{}_DEAD", stream.name);
    let stats = consume_until(&db, &consumer, || async {
        stream.messages_in(&dead).await == 1
    })
    .await;
    assert_eq!(stats.dead_lettered, 1);
    let letter = (stream.jetstream.get_stream(&dead).await.unwrap())
        .get_raw_message(1)
        .await
        .unwrap();
    let reason = letter.headers.get(REASON_HEADER).unwrap().as_str();
    assert_eq!(reason, "the message has no header Order-Id");
    stream.delete().await;
    db.cleanup().await;
}

async fn a_reader_runs_failing_work_again_in_place_then_dead_letters_it_and_moves_on<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    for key in ["fail1:order", "bad:order", "order:after"] {
        stream.0.publish(key, key.as_bytes()).await;
    }
    let reader = NatsReader::connect(
        &nats_url(),
        db.inbox.clone(),
        options(&stream.0).max_attempts(2),
    )
    .await
    .unwrap();
    let stats = consume_until(&db, &reader, || stream.settled(&db)).await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (2, 2, 1)
    );
    for (key, effects) in [("fail1:order", 1), ("bad:order", 0), ("order:after", 1)] {
        assert_eq!(
            db.effects_of(&Key::new(key).unwrap()).await,
            effects,
            "{key}"
        );
    }
    let dead = format!("{}_DEAD", stream.0.name);
    let letter = (stream.0.jetstream.get_stream(&dead).await.unwrap())
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(&letter.payload[..], b"bad:order");
    let reason = letter.headers.get(REASON_HEADER).unwrap().as_str();
    assert!(reason.contains("attempt 2: "), "{reason}");
    assert_eq!(stream.positions(&db).await, (3, Some(3)));
    stream.delete().await;
    db.cleanup().await;
}

/// A reader runs its batches one after the other unless told otherwise: each entry's work
/// sees what every entry before it wrote, in its batch and in the batches before. Each work
/// here counts the effects before it writes its own: the count is the entry's place.
async fn a_readers_work_sees_what_every_entry_before_it_wrote<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    let keys: Vec<String> = (0..300).map(|n| format!("order:{n}")).collect();
    stream.publish(&keys).await;
    let reader = NatsReader::connect(&nats_url(), db.inbox.clone(), options(&stream.0))
        .await
        .unwrap();
    let prefix = db.prefix.clone();
    let stale = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let done = async {
        while db.rows("effects").await < 300 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop.send(());
    };
    let noted = stale.clone();
    let running = reader.run_batched(stopped, 20, move |tx, message: &Incoming| {
        let (stale, prefix) = (noted.clone(), prefix.clone());
        let key = message.key.as_str().to_owned();
        Box::pin(async move {
            let count = format!("SELECT COUNT(*) FROM {prefix}effects");
            let before = DB::count_in(tx, count).await?;
            let place: i64 = key.trim_start_matches("order:").parse().unwrap();
            if before != place {
                stale.lock().unwrap().push((key.clone(), before));
            }
            DB::insert_effect(tx, &prefix, "test", &key).await
        }) as WorkFuture<'_, (), justonce_sql::sqlx::Error>
    });
    let (stats, ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(running, done)
    })
    .await
    .expect("300 effects within 60 s");
    assert_eq!(stats.unwrap().processed, 300);
    assert_eq!(stale.lock().unwrap().clone(), Vec::<(String, i64)>::new());
    assert_eq!(stream.positions(&db).await, (300, Some(300)));
    stream.delete().await;
    db.cleanup().await;
}

async fn the_relay_publishes_with_its_key_and_the_stream_drops_a_repeat<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    // Creates the stream the destination publishes into.
    let _consumer = NatsConsumer::connect(&nats_url(), db.inbox.clone(), options(&stream))
        .await
        .unwrap();
    let destination = NatsDestination::new(&nats_url(), &stream.name);
    let headers = [("Order-Id".to_owned(), "order:1".to_owned())];
    let delivery = Delivery {
        id: 1,
        key: "billing:invoice:2026-10",
        destination: "orders",
        payload: b"invoice",
        headers: &headers,
        attempt: 1,
    };
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    // The relay sends a row again when its mark was lost: the stream keeps one copy.
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    assert_eq!(stream.messages_in(&stream.name).await, 1);
    let stored = stream
        .jetstream
        .get_stream(&stream.name)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(&stored.payload[..], b"invoice");
    assert_eq!(
        stored.headers.get(MSG_ID_HEADER).unwrap().as_str(),
        "billing:invoice:2026-10"
    );
    stream.delete().await;
    db.cleanup().await;
}

impl super::broker::Restartable for Stream {
    const KIND: &'static str = "nats";
    type Adapter = justonce_transport::nats::Nats;

    async fn connect_to<DB: TestBackend>(
        url: &str,
        name: &str,
        inbox: &Inbox<DB>,
    ) -> NatsConsumer<DB> {
        let options = NatsOptions::new(name, name).reconnect_max_wait(Duration::from_millis(200));
        NatsConsumer::connect(url, inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn publish_to(url: &str, name: &str, key: &str) {
        super::broker::deliver(&NatsDestination::new(url, name), key).await;
    }
}

impl GivingBack for Stream {
    type Adapter = justonce_transport::nats::Nats;

    fn generic<DB: TestBackend>(consumer: NatsConsumer<DB>) -> NatsConsumer<DB> {
        consumer
    }
}

impl OneAttempt for Stream {
    async fn connect_with_one_attempt<DB: TestBackend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> NatsConsumer<DB> {
        let options = options(self)
            .ack_wait(Duration::from_secs(1))
            .max_attempts(1);
        NatsConsumer::connect(&nats_url(), inbox.clone(), options)
            .await
            .unwrap()
    }
}

impl Batching for Stream {
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> NatsConsumer<DB> {
        let options = options(self)
            .ack_wait(Duration::from_secs(1))
            .max_attempts(2);
        NatsConsumer::connect(&nats_url(), inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> u64 {
        self.messages_in(&format!("{}_DEAD", self.name)).await
    }
}

impl TestBroker for Stream {
    type Consumer<DB: TestBackend> = NatsConsumer<DB>;

    fn url() -> String {
        nats_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let stream = Stream::new(db).await;
        // Creates the streams and the durable consumer.
        TestBroker::connect(&stream, db).await;
        stream
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, keys: &[String]) {
        for key in keys {
            Stream::publish(self, key, b"x").await;
        }
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> NatsConsumer<DB> {
        // A short ack wait: what a killed worker held comes back within a second.
        let options = options(self).ack_wait(Duration::from_secs(1));
        NatsConsumer::connect(&nats_url(), db.inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        consumer: &NatsConsumer<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        take(consumer, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, _db: &TestDb<DB>) -> bool {
        self.unsettled().await == 0
    }

    async fn delete(self) {
        Stream::delete(self).await
    }
}

/// The stream of a test read by a single reader that keeps its offset in the database.
pub(crate) struct ReadStream(Stream);

impl Batching for ReadStream {
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> NatsReader<DB> {
        let options = options(&self.0).max_attempts(2);
        NatsReader::connect(&nats_url(), inbox.clone(), options)
            .await
            .unwrap()
            .batches_at_once(2)
    }

    async fn dead_letters(&self) -> u64 {
        self.0.dead_letters().await
    }
}

impl ReadStream {
    /// The stream's last sequence, and the reader's stored offset.
    async fn positions<DB: TestBackend>(&self, db: &TestDb<DB>) -> (u64, Option<u64>) {
        let offset_stream = format!("{0}:{0}", self.0.name);
        let stored = db.inbox.load_offsets(&offset_stream).await.unwrap();
        let last = self.0.jetstream.get_stream(&self.0.name).await.unwrap();
        let last = last.get_info().await.unwrap().state.last_sequence;
        let stored = stored.first().map(|(_, offset)| offset.position as u64);
        (last, stored)
    }
}

impl TestBroker for ReadStream {
    type Consumer<DB: TestBackend> = NatsReader<DB>;
    const KEEPS_OFFSET: bool = true;

    fn url() -> String {
        nats_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let stream = ReadStream(Stream::new(db).await);
        // Creates the streams.
        TestBroker::connect(&stream, db).await;
        stream
    }

    fn name(&self) -> &str {
        &self.0.name
    }

    async fn publish(&self, keys: &[String]) {
        TestBroker::publish(&self.0, keys).await
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> NatsReader<DB> {
        NatsReader::connect(&nats_url(), db.inbox.clone(), options(&self.0))
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        reader: &NatsReader<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        read_to_end(self, reader, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> bool {
        let (last, stored) = self.positions(db).await;
        stored == Some(last)
    }

    async fn delete(self) {
        self.0.delete().await
    }
}

/// Slow work and a short ack wait: the server's ack wait runs from when it sends a message,
/// so what the consumer pulled ahead must be worked within it. A prefetch sized to the work
/// sees no message twice; the default of 64 would, by seconds.
#[tokio::test]
async fn a_prefetch_sized_to_the_work_sees_no_message_twice() {
    const MESSAGES: usize = 30;
    const WORK: Duration = Duration::from_millis(150);
    let db = TestDb::<justonce_sql::sqlx::Postgres>::new("nats_prefetch").await;
    let stream = Stream::new(&db).await;
    let consumer = NatsConsumer::connect(
        &nats_url(),
        db.inbox.clone(),
        options(&stream)
            .ack_wait(Duration::from_secs(2))
            .prefetch(2),
    )
    .await
    .unwrap();
    for n in 0..MESSAGES {
        stream.publish(&format!("order:{n}"), b"x").await;
    }
    let work = consumer_work(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut messages = consumer.deliveries().await.unwrap();
    // Past the last message, longer than the ack wait: a late redelivery would come.
    while let Ok(next) = tokio::time::timeout(Duration::from_secs(3), messages.next()).await {
        let message = next.unwrap().expect("the stream is open");
        tokio::time::sleep(WORK).await;
        let ran = consumer.run_one(&message, &work).await;
        consumer.settle(&message, ran, &mut stats).await.unwrap();
    }
    assert_eq!((stats.processed, stats.duplicates), (MESSAGES as u64, 0));
    assert_eq!(db.rows("effects").await, MESSAGES as i64);
    stream.delete().await;
    db.cleanup().await;
}
