//! Connecting to RabbitMQ, declaring queues and publishing with confirms.

use super::adapter::Unsettled;
use super::options::{AmqpOptions, QueueType};
use crate::Error;
use crate::tls::Tls;
use lapin::options::{
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::types::{AMQPValue, FieldTable};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A consumer's connection, its channel, and the channel's deliveries not settled.
pub(super) type Open = (Arc<Connection>, Channel, Arc<Unsettled>);

/// Connects to `url` and prepares a consumer's channel: publisher confirms, the prefetch,
/// and the queues unless they are declared elsewhere.
pub(super) async fn open(url: &str, options: &AmqpOptions) -> Result<Open, Error> {
    let connection = connect(url, options.tls.as_ref()).await?;
    let channel = open_channel(&connection).await?;
    channel
        .basic_qos(options.prefetch, BasicQosOptions::default())
        .await
        .map_err(broker)?;
    if options.declare {
        let dead = &options.dead_letter_queue;
        let queue = Declared {
            name: &options.queue,
            queue_type: options.queue_type,
            dead_letters: Some(dead),
            delivery_limit: options.delivery_limit,
        };
        declare(&connection, &channel, queue).await?;
        let dead = Declared {
            name: dead,
            queue_type: options.queue_type,
            dead_letters: None,
            delivery_limit: None,
        };
        declare(&connection, &channel, dead).await?;
    }
    Ok((Arc::new(connection), channel, Arc::default()))
}

/// Proves that the broker at `url` takes a consumer with `options`: opens a connection with
/// its TLS settings, whose AMQP handshake completes only once the broker has accepted the
/// credentials and the virtual host, and closes it. Declares and consumes nothing. Gives up
/// after [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &AmqpOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let connection = connect(url, options.tls.as_ref()).await?;
        connection.close(200, "probed".into()).await.map_err(broker)
    })
    .await
}

/// Connects to `url`; an `amqps://` URL over TLS with `tls`, or the defaults. Gives up
/// after [`CONNECT_WAIT`]: lapin has no bound of its own, and a connection failing while
/// its handshake starts can leave lapin waiting for it forever.
pub(super) async fn connect(url: &str, tls: Option<&Tls>) -> Result<Connection, Error> {
    let uri: AMQPUri = url
        .parse()
        .map_err(|e| Error::Config(format!("AMQP URL: {e}")))?;
    // lapin's own TLS takes no verifier and adds a CA to the system's roots: the connection
    // is made here with the one rustls configuration every broker uses.
    let connector = match (uri.scheme == AMQPScheme::AMQPS, tls) {
        (true, tls) => {
            let config = tls.cloned().unwrap_or_default().client_config()?;
            Some(RustlsConnector::from(Arc::new(config)))
        }
        (false, None) => None,
        (false, Some(_)) => {
            return Err(Error::Config(
                "TLS settings need an amqps:// URL".to_owned(),
            ));
        }
    };
    let socket = Opening::default();
    let kept = Arc::clone(&socket.0);
    let open = async move |uri: AMQPUri, _| {
        let host = uri.authority.host.as_str();
        let stream = tokio::net::TcpStream::connect((host, uri.authority.port)).await?;
        stream.set_nodelay(true)?;
        let stream = stream.into_std()?;
        *crate::lock(&kept) = Some(stream.try_clone()?);
        let stream = tokio::net::TcpStream::from_std(stream)?;
        let stream = AsyncTcpStream::Plain(async_compat::Compat::new(stream));
        Ok(match &connector {
            Some(connector) => stream.into_rustls(connector, host).await?,
            None => stream,
        })
    };
    let runtime = lapin::runtime::default_runtime().map_err(broker)?;
    let opening = Connection::connector(uri, runtime, open, ConnectionProperties::default());
    let Ok(opened) = tokio::time::timeout(CONNECT_WAIT, opening).await else {
        return Err(Error::Broker(
            format!("no connection within {} s", CONNECT_WAIT.as_secs()).into(),
        ));
    };
    let connection = opened.map_err(broker)?;
    socket.opened();
    Ok(connection)
}

/// A copy of the socket of a connection being opened, shut down when dropped unless it
/// opened: lapin's IO thread waits on the socket until it closes, past a caller that gave
/// up on it.
#[derive(Default)]
struct Opening(Arc<std::sync::Mutex<Option<std::net::TcpStream>>>);

impl Opening {
    /// The connection holds its own socket: the copy goes, open.
    fn opened(self) {
        crate::lock(&self.0).take();
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(copy) = crate::lock(&self.0).take() {
            let _ = copy.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// How long opening a connection may take: a TCP connect, TLS, and the AMQP handshake.
const CONNECT_WAIT: Duration = Duration::from_secs(15);

pub(super) async fn open_channel(connection: &Connection) -> Result<Channel, Error> {
    let channel = connection.create_channel().await.map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    Ok(channel)
}

/// A queue as [`declare`] declares it.
struct Declared<'q> {
    name: &'q str,
    queue_type: QueueType,
    /// Where a quorum queue dead-letters what passes the broker's delivery limit.
    dead_letters: Option<&'q str>,
    /// A quorum queue's `x-delivery-limit`.
    delivery_limit: Option<u32>,
}

/// Declares `queue` durable, of its type. A quorum queue dead-letters to its dead letters
/// what passes the broker's own delivery limit, which would otherwise drop it. A refusal is
/// a setting to fix; a connection lost meanwhile is not.
async fn declare(
    connection: &Connection,
    channel: &Channel,
    queue: Declared<'_>,
) -> Result<(), Error> {
    let Declared {
        name: queue,
        queue_type,
        dead_letters,
        delivery_limit,
    } = queue;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut arguments = FieldTable::default();
    if queue_type == QueueType::Quorum {
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        if let Some(dead_letters) = dead_letters {
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            arguments.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(dead_letters.into()),
            );
        }
        if let Some(limit) = delivery_limit {
            arguments.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(limit)),
            );
        }
    }
    let declared = channel
        .queue_declare(queue.into(), durable, arguments)
        .await;
    match declared {
        Ok(_) => Ok(()),
        Err(error) if !connection.status().connected() => Err(broker(error)),
        Err(error) => Err(Error::Config(format!("declaring queue {queue}: {error}"))),
    }
}

/// The answer lapin gives a settlement: false when it did not send it, because its channel
/// closed (or it was settled before).
pub(super) fn taken(sent: bool) -> Result<(), Error> {
    if sent {
        Ok(())
    } else {
        Err(Error::Broker(
            "the delivery was not settled: its channel closed, or it was settled before".into(),
        ))
    }
}

/// Publishes persistently with `mandatory`, and waits for the broker's confirm: a nack or
/// a returned (unroutable) message is an error.
pub(super) async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<(), Error> {
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let publish = channel.basic_publish(
        exchange.into(),
        routing_key.into(),
        mandatory,
        payload,
        properties.with_delivery_mode(2),
    );
    let confirm = while_open(channel, publish).await?;
    let confirm = while_open(channel, confirm).await?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => Err(Error::Broker(
            format!(
                "no queue took the message (exchange {exchange:?}, routing key {routing_key:?})"
            )
            .into(),
        )),
        other => Err(Error::Broker(
            format!("the broker did not confirm the message: {other:?}").into(),
        )),
    }
}

/// How often a pending call checks that its channel is still open.
const OPEN_CHECK: Duration = Duration::from_millis(200);

/// How long [`Broker::close`] waits for each goodbye.
const GOODBYE_WAIT: Duration = Duration::from_secs(5);

/// Awaits `call`, failing once `channel` is no longer open. When the connection dies under
/// it, lapin can leave a call (an ack, a confirm, a `basic.cancel`) pending for ever: the
/// consumer would then neither consume nor exit.
pub(super) async fn while_open<T>(
    channel: &Channel,
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, Error> {
    let closed = async {
        while channel.status().connected() {
            tokio::time::sleep(OPEN_CHECK).await;
        }
    };
    tokio::select! {
        biased;
        done = call => done.map_err(broker),
        () = closed => Err(channel_closed()),
    }
}

pub(super) fn channel_closed() -> Error {
    Error::Broker("the channel to RabbitMQ closed with a call pending".into())
}

/// Awaits a goodbye for at most [`GOODBYE_WAIT`].
pub(super) async fn within_goodbye_wait(
    goodbye: impl Future<Output = Result<(), lapin::Error>>,
) -> Result<(), Error> {
    tokio::time::timeout(GOODBYE_WAIT, goodbye)
        .await
        .map_err(|_| {
            Error::Broker(
                format!("RabbitMQ did not answer the close within {GOODBYE_WAIT:?}").into(),
            )
        })?
        .map_err(broker)
}

pub(super) fn broker(error: lapin::Error) -> Error {
    // 403 ACCESS_REFUSED: a login refused, or a user without the right to what it asked.
    if let lapin::ErrorKind::ProtocolError(refused) = error.kind()
        && refused.get_id() == 403
    {
        return crate::refused_access(refused.get_message());
    }
    crate::tls::broker_error(error)
}
