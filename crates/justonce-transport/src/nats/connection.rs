//! Connecting to NATS, opening the streams and publishing dead letters.

use super::options::{MSG_ID_HEADER, NatsOptions};
use crate::tls::Tls;
use crate::{ATTEMPT_HEADER, Error, REASON_BYTES, REASON_HEADER, truncate};
use async_nats::jetstream::{self};

/// Connects to `url` and opens the stream of `options`, creating it and its dead-letter
/// stream (with file storage) unless they are declared elsewhere.
pub(super) async fn open_stream(
    url: &str,
    options: &NatsOptions,
) -> Result<(jetstream::Context, jetstream::stream::Stream), Error> {
    let jetstream = jetstream::new(connect(url, options.tls.as_ref()).await?);
    if options.declare {
        let dead = format!("{}_DEAD", options.stream);
        for (name, subject) in [
            (&dead, options.dead_letter_subject()),
            (&options.stream, options.subject.clone()),
        ] {
            let stream = jetstream
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subject],
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: options.replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| Error::Config(format!("creating stream {name}: {e}")))?;
            // A stream that existed keeps its own copies: say so, or a user who asked for
            // three would believe the stream survives a server's loss.
            let kept = stream.cached_info().config.num_replicas;
            if kept != options.replicas {
                tracing::warn!(
                    stream = %name,
                    replicas = kept,
                    asked = options.replicas,
                    "the stream existed with other replicas and keeps them"
                );
            }
        }
    }
    let stream = jetstream
        .get_stream(&options.stream)
        .await
        .map_err(|e| Error::Config(format!("stream {}: {e}", options.stream)))?;
    Ok((jetstream, stream))
}

/// Whether the client is connected: async-nats connects again by itself, so connecting
/// again is waiting for it.
pub(super) fn connected(jetstream: &jetstream::Context) -> Result<(), Error> {
    match jetstream.client().connection_state() {
        async_nats::connection::State::Connected => Ok(()),
        state => Err(Error::Broker(
            format!("the client has not connected again yet ({state:?})").into(),
        )),
    }
}

/// Publishes the message, with its headers and the reason, to the dead-letter subject and
/// waits for the stream to store it.
pub(super) async fn dead_letter(
    jetstream: &jetstream::Context,
    options: &NatsOptions,
    message: &jetstream::Message,
    attempt: u32,
    reason: &str,
) -> Result<(), Error> {
    let mut headers = message.headers.clone().unwrap_or_default();
    headers.insert(ATTEMPT_HEADER, attempt.to_string().as_str());
    headers.insert(REASON_HEADER, truncate(reason, REASON_BYTES));
    // A dead letter is its own message: the original id would be deduplicated away. The
    // stream sequence makes a letter published twice (by a reader that died before it moved
    // its offset) one.
    let stream_sequence = message.info().map(|info| info.stream_sequence).unwrap_or(0);
    headers.insert(
        MSG_ID_HEADER,
        format!("dead:{}:{stream_sequence}", options.stream).as_str(),
    );
    jetstream
        .publish_with_headers(
            options.dead_letter_subject(),
            headers,
            message.payload.clone(),
        )
        .await
        .map_err(broker)?
        .await
        .map(drop)
        .map_err(broker)
}

/// Proves that the server at `url` takes a consumer with `options`: connects with its TLS
/// settings (the server answers the connect only once it has accepted the credentials),
/// checks that the account has JetStream, which every consumer here reads through, and
/// drains the connection. Creates and consumes nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &NatsOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let client = connect(url, options.tls.as_ref()).await?;
        // The account's JetStream information, read loosely: its fields vary between
        // server versions, and only whether the server answers it with an error matters.
        let account: Result<jetstream::response::Response<serde_json::Value>, _> =
            jetstream::new(client.clone()).request("INFO", b"").await;
        let drained = client.drain().await;
        match account {
            Ok(jetstream::response::Response::Ok(_)) => {}
            Ok(jetstream::response::Response::Err { error }) => {
                return Err(Error::Broker(format!("JetStream: {error}").into()));
            }
            // Nothing answers the JetStream API where the server runs without it.
            Err(error) if error.kind() == jetstream::context::RequestErrorKind::NoResponders => {
                return Err(Error::Broker(
                    "JetStream is not enabled on the server for this account".into(),
                ));
            }
            Err(error) => return Err(Error::Broker(format!("JetStream: {error}").into())),
        }
        drained.map_err(broker)
    })
    .await
}

/// Connects to `url`, which may list the servers of a cluster separated by commas
/// (`nats://a:4222,nats://b:4222`): the client connects to the first of them that answers,
/// in random order, and to another when it loses one. With `tls`, over TLS whether or not
/// the server requires it.
pub(super) async fn connect(url: &str, tls: Option<&Tls>) -> Result<async_nats::Client, Error> {
    let options = match tls {
        Some(tls) => async_nats::ConnectOptions::new()
            .tls_client_config(tls.client_config()?)
            .require_tls(true),
        None => async_nats::ConnectOptions::new(),
    };
    let servers = url
        .split(',')
        .map(|server| server.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Config(format!("NATS URL: {e}")))?;
    with_login(options, &servers)
        .connect(servers.as_slice())
        .await
        .map_err(|error| match error.kind() {
            async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication => crate::refused_access(error),
            _ => broker(error),
        })
}

/// The login of the first server URL that has one: `user:password@` or `token@`, each
/// percent-decoded. The client reads the servers' addresses from the URLs but not their
/// logins.
fn with_login(
    options: async_nats::ConnectOptions,
    servers: &[async_nats::ServerAddr],
) -> async_nats::ConnectOptions {
    let decoded = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let login = servers
        .iter()
        .find_map(|server| Some((decoded(server.username()?), server.password().map(decoded))));
    match login {
        Some((user, Some(password))) => options.user_and_password(user, password),
        Some((token, None)) => options.token(token),
        None => options,
    }
}

pub(super) fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    crate::tls::broker_error(error)
}
