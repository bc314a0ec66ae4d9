//! The MQTT consumer and publisher against the real broker, with the keys on each real
//! database: failures published again then dead-lettered, and the relay's publisher. The
//! proofs every broker shares are in `broker`.

use super::broker::{Batching, GivingBack, TestBroker, take};
use super::on_every_database;
use justonce_sql::{Delivered, Delivery, Destination, Inbox, Key};
use justonce_tests::{
    TestBackend, TestDb, consumer_work, mqtt_options, mqtt_url, shared_mqtt_options,
};
use justonce_transport::mqtt::{KEY_PROPERTY, Message, MqttConsumer, MqttDestination};
use justonce_transport::{ConsumerStats, KeyFrom, REASON_HEADER};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use std::time::Duration;

on_every_database!(
    ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key,
    failing_work_is_published_again_then_dead_lettered,
    a_message_without_its_key_property_is_dead_lettered_with_the_reason,
    the_relay_publishes_with_its_key,
);

/// The topic of one test, named after its prefix.
fn topic<DB: TestBackend>(db: &TestDb<DB>) -> String {
    format!("{}orders", db.prefix)
}

/// Publishes one message per key through justonce's own publisher, each acknowledged by the
/// broker before the next.
async fn publish(topic: &str, keys: impl IntoIterator<Item = String>) {
    let publisher = MqttDestination::new(&mqtt_url(), topic, &format!("{topic}-p")).unwrap();
    for (n, key) in keys.into_iter().enumerate() {
        let delivery = Delivery {
            id: n as i64,
            key: &key,
            destination: "orders",
            payload: b"x",
            headers: &[],
            attempt: 1,
        };
        assert_eq!(
            publisher.deliver(delivery).await,
            Delivered::Sent,
            "MQTT at {}",
            mqtt_url()
        );
    }
}

/// The settings of a plain rumqttc client `client_id` on the tests' broker.
fn raw_options(client_id: &str) -> rumqttc::v5::MqttOptions {
    let url = mqtt_url();
    let address = url.trim_start_matches("mqtt://").trim_end_matches('/');
    let (host, port) = address.rsplit_once(':').unwrap_or((address, "1883"));
    let port = port.parse().expect("a port in the MQTT URL");
    rumqttc::v5::MqttOptions::new(client_id, host, port)
}

/// Takes the persistent session of `client_id` over and leaves it with a DISCONNECT the
/// broker has read. A consumer dropped a moment ago may still hold its connection: a
/// message sent there unacknowledged would reach the next client flagged DUP, as a
/// possible re-run, which runs alone.
async fn leave_session(client_id: &str) {
    let mut options = raw_options(client_id);
    options.set_clean_start(false);
    options.set_session_expiry_interval(Some(300));
    let (client, mut events) = rumqttc::v5::AsyncClient::new(options, 16);
    let connected = async {
        loop {
            match events.poll().await {
                Ok(rumqttc::v5::Event::Incoming(Packet::ConnAck(_))) => break,
                Ok(_) => {}
                Err(error) => panic!("MQTT at {}: {error}", mqtt_url()),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), connected)
        .await
        .expect("connected within 10 s");
    client.disconnect().await.unwrap();
    // The event loop ends once the DISCONNECT is sent.
    let left = async { while events.poll().await.is_ok() {} };
    tokio::time::timeout(Duration::from_secs(10), left)
        .await
        .expect("left the session within 10 s");
}

/// A plain subscriber on `topic` with a clean session, answered by the broker before it
/// returns, and the messages it receives.
async fn subscriber(topic: &str) -> tokio::sync::mpsc::UnboundedReceiver<Message> {
    let mut options = raw_options(&format!("{topic}-s"));
    options.set_clean_start(true);
    let (client, mut events) = rumqttc::v5::AsyncClient::new(options, 16);
    client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let (messages_tx, messages) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _client = client;
        let mut subscribed_tx = Some(subscribed_tx);
        while let Ok(event) = events.poll().await {
            match event {
                rumqttc::v5::Event::Incoming(Packet::SubAck(_)) => {
                    if let Some(tx) = subscribed_tx.take() {
                        let _ = tx.send(());
                    }
                }
                rumqttc::v5::Event::Incoming(Packet::Publish(message)) => {
                    let _ = messages_tx.send(message);
                }
                _ => {}
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), subscribed)
        .await
        .expect("subscribed within 10 s")
        .unwrap();
    messages
}

/// Published while consumed: Mosquitto keeps at most 1,000 messages per session.
async fn ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = topic(&db);
    let consumer = MqttConsumer::connect(&mqtt_url(), db.inbox.clone(), mqtt_options(&topic))
        .await
        .unwrap();
    let stats =
        justonce_tests::publish_while_consuming(&db.prefix, &consumer, &topic, (10_000, 8_000), 1)
            .await;
    assert_eq!((stats.processed, stats.duplicates), (8_000, 2_000));
    assert_eq!(db.rows("effects").await, 8_000, "effects = distinct keys");
    assert_eq!(db.doubled_effects().await, 0);
    db.cleanup().await;
}

async fn failing_work_is_published_again_then_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let topic = topic(&db);
    let dead_topic = format!("{topic}/dead");
    let mut dead = subscriber(&dead_topic).await;
    let consumer = MqttConsumer::connect(
        &mqtt_url(),
        db.inbox.clone(),
        mqtt_options(&topic)
            .max_attempts(2)
            .dead_letter_topic(&dead_topic),
    )
    .await
    .unwrap();
    publish(&topic, ["fail1:order".to_owned(), "bad:order".to_owned()]).await;
    // fail1 fails once then succeeds; bad fails, then fails again and is dead-lettered.
    let stats = take(&consumer, &db, 4).await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (1, 2, 1)
    );
    assert_eq!(db.effects_of(&Key::new("fail1:order").unwrap()).await, 1);
    assert_eq!(db.effects_of(&Key::new("bad:order").unwrap()).await, 0);
    let letter = tokio::time::timeout(Duration::from_secs(10), dead.recv())
        .await
        .expect("a dead letter")
        .unwrap();
    assert_eq!(property(&letter, KEY_PROPERTY), "bad:order");
    assert!(property(&letter, REASON_HEADER).contains("refused on attempt 2"));
    assert_eq!(&letter.payload[..], b"x");
    db.cleanup().await;
}

/// A user property of `message`, or nothing.
fn property(message: &Message, name: &str) -> String {
    let properties = message.properties.as_ref().unwrap();
    let found = properties.user_properties.iter().find(|(n, _)| n == name);
    found.map(|(_, value)| value.clone()).unwrap_or_default()
}

async fn a_message_without_its_key_property_is_dead_lettered_with_the_reason<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = topic(&db);
    let dead_topic = format!("{topic}/dead");
    let mut dead = subscriber(&dead_topic).await;
    let options = mqtt_options(&topic)
        .key_from(KeyFrom::Header("order-id".into()))
        .dead_letter_topic(&dead_topic);
    let consumer = MqttConsumer::connect(&mqtt_url(), db.inbox.clone(), options)
        .await
        .unwrap();
    publish(&topic, ["order:1".to_owned()]).await;
    let stats = take(&consumer, &db, 1).await;
    assert_eq!(stats.dead_lettered, 1);
    let letter = tokio::time::timeout(Duration::from_secs(10), dead.recv())
        .await
        .expect("a dead letter")
        .unwrap();
    assert_eq!(
        property(&letter, REASON_HEADER),
        "the message has no user property order-id"
    );
    db.cleanup().await;
}

async fn the_relay_publishes_with_its_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let topic = topic(&db);
    let consumer = MqttConsumer::connect(&mqtt_url(), db.inbox.clone(), mqtt_options(&topic))
        .await
        .unwrap();
    let destination = MqttDestination::new(&mqtt_url(), &topic, &format!("{topic}-relay")).unwrap();
    let headers = [
        ("content-type".to_owned(), "text/plain".to_owned()),
        ("x-source".to_owned(), "billing".to_owned()),
    ];
    let delivery = Delivery {
        id: 1,
        key: "billing:invoice:2026-10",
        destination: "orders",
        payload: b"invoice",
        headers: &headers,
        attempt: 1,
    };
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    // The relay sends a row again when its mark was lost: two messages, one key.
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    let mut messages = consumer.deliveries().await.unwrap();
    let first = messages.next().await.unwrap().unwrap();
    let properties = first.properties.clone().unwrap();
    assert_eq!(properties.content_type.as_deref(), Some("text/plain"));
    assert!(properties.user_properties.contains(&(
        KEY_PROPERTY.to_owned(),
        "billing:invoice:2026-10".to_owned()
    )));
    assert!(
        properties
            .user_properties
            .contains(&("x-source".to_owned(), "billing".to_owned()))
    );
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let ran = consumer.run_one(&first, &work).await;
    consumer.settle(&first, ran, &mut stats).await.unwrap();
    let second = messages.next().await.unwrap().unwrap();
    let ran = consumer.run_one(&second, &work).await;
    consumer.settle(&second, ran, &mut stats).await.unwrap();
    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert_eq!(
        db.effects_of(&Key::new("billing:invoice:2026-10").unwrap())
            .await,
        1
    );
    db.cleanup().await;
}

/// The topic of one test, with the persistent session its consumers share.
pub(crate) struct Topic {
    name: String,
    /// What reached `<name>/dead`, and how many so far.
    dead: tokio::sync::Mutex<(tokio::sync::mpsc::UnboundedReceiver<Message>, u64)>,
}

impl Topic {
    /// The topic of the test, with a subscriber on its dead-letter topic.
    async fn new<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let name = topic(db);
        let dead = subscriber(&format!("{name}/dead")).await;
        Topic {
            name,
            dead: tokio::sync::Mutex::new((dead, 0)),
        }
    }
}

impl super::broker::Restartable for Topic {
    const KIND: &'static str = "mqtt";
    type Adapter = justonce_transport::mqtt::Mqtt;

    async fn connect_to<DB: TestBackend>(
        url: &str,
        name: &str,
        inbox: &Inbox<DB>,
    ) -> MqttConsumer<DB> {
        let options = mqtt_options(name).reconnect_max_wait(Duration::from_millis(200));
        MqttConsumer::connect(url, inbox.clone(), options)
            .await
            .unwrap()
    }

    /// Each publisher has a client id of its own: one taken by another client is refused.
    async fn publish_to(url: &str, name: &str, key: &str) {
        let destination = MqttDestination::new(url, name, &format!("{name}-{key}")).unwrap();
        super::broker::deliver(&destination, key).await;
    }
}

impl GivingBack for Topic {
    type Adapter = justonce_transport::mqtt::Mqtt;

    fn generic<DB: TestBackend>(consumer: MqttConsumer<DB>) -> MqttConsumer<DB> {
        consumer
    }
}

impl Batching for Topic {
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> MqttConsumer<DB> {
        let options = mqtt_options(&self.name)
            .max_attempts(2)
            .dead_letter_topic(format!("{}/dead", self.name));
        MqttConsumer::connect(&mqtt_url(), inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> u64 {
        let mut dead = self.dead.lock().await;
        while dead.0.try_recv().is_ok() {
            dead.1 += 1;
        }
        dead.1
    }
}

impl TestBroker for Topic {
    type Consumer<DB: TestBackend> = MqttConsumer<DB>;

    fn url() -> String {
        mqtt_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let topic = Topic::new(db).await;
        // Makes the session and its subscription, then leaves, so that messages published
        // next wait in the broker for the session's client.
        drop(TestBroker::connect(&topic, db).await);
        leave_session(&format!("{}-c", topic.name)).await;
        topic
    }

    async fn open_shared<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let topic = Topic::new(db).await;
        for member in ["1", "2"] {
            let options = shared_mqtt_options(&topic.name, member);
            drop(
                MqttConsumer::connect(&mqtt_url(), db.inbox.clone(), options)
                    .await
                    .unwrap(),
            );
            leave_session(&format!("{}-m{member}", topic.name)).await;
        }
        topic
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, keys: &[String]) {
        publish(&self.name, keys.iter().cloned()).await
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> MqttConsumer<DB> {
        MqttConsumer::connect(&mqtt_url(), db.inbox.clone(), mqtt_options(&self.name))
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        consumer: &MqttConsumer<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        take(consumer, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, _db: &TestDb<DB>) -> bool {
        // Mosquitto does not say what a session holds.
        true
    }

    async fn delete(self) {
        // A topic is not stored; the session expires on its own.
    }
}
