//! Connecting to Redis.

use super::adapter::READ_BLOCK;
use super::options::RedisStreamOptions;
use crate::Error;
use crate::tls::Tls;
use redis::IntoConnectionInfo;
use redis::aio::MultiplexedConnection;
use std::time::Duration;

/// Proves that the server at `url` takes a consumer with `options`: connects with its TLS
/// settings and the URL's login, and sends `PING`, which a server that wants a login (or
/// another one) refuses. Creates and reads nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &RedisStreamOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let mut redis = connect(url, options.tls.as_ref()).await?;
        // Dropping the connection closes it: Redis has no goodbye but the deprecated QUIT.
        redis::cmd("PING")
            .query_async::<String>(&mut redis)
            .await
            .map(drop)
            .map_err(broker)
    })
    .await
}

/// Connects to `url` with a response timeout past the time a read blocks on the server; a
/// `rediss://` URL over TLS with `tls`, or the defaults.
pub(super) async fn connect(url: &str, tls: Option<&Tls>) -> Result<MultiplexedConnection, Error> {
    let info = connection_info(url)?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(READ_BLOCK + Duration::from_secs(10)));
    let redis::ConnectionAddr::TcpTls {
        host,
        port,
        insecure,
        ..
    } = info.addr().clone()
    else {
        if tls.is_some() {
            return Err(Error::Config(
                "TLS settings need a rediss:// URL".to_owned(),
            ));
        }
        return redis::Client::open(info)
            .map_err(|e| Error::Config(format!("Redis URL: {e}")))?
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(broker);
    };
    if insecure {
        return Err(Error::Config(
            "the Redis URL's #insecure is not taken: turn verification off in the TLS settings"
                .to_owned(),
        ));
    }
    // The handshake is made here, with the rustls configuration every broker uses, so that
    // its failure is told apart from a server that is down: redis keeps only its text.
    let tls = tls.cloned().unwrap_or_default().client_config()?;
    let server_name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.clone())
        .map_err(|e| Error::Config(format!("Redis URL: the host {host}: {e}")))?;
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(broker)?;
    tcp.set_nodelay(true).map_err(broker)?;
    let mut stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect(server_name, tcp)
        .await
        .map_err(broker)?;
    // Under TLS 1.3 a server refuses a client certificate after the handshake, at the
    // first read: a PING answered here shows it as a TLS failure, which redis would turn
    // into text.
    ping(&mut stream).await?;
    let (redis, driver) =
        MultiplexedConnection::new_with_config(info.redis_settings(), stream, config)
            .await
            .map_err(broker)?;
    tokio::spawn(driver);
    Ok(redis)
}

/// Sends `PING` and reads the answer's line (`+PONG`, or an error such as `-NOAUTH` before
/// the login): whatever the server says, it took the connection.
async fn ping(
    stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
) -> Result<(), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(b"PING\r\n").await.map_err(broker)?;
    stream.flush().await.map_err(broker)?;
    let mut byte = [0u8];
    loop {
        if stream.read(&mut byte).await.map_err(broker)? == 0 {
            return Err(Error::Broker("the server closed the connection".into()));
        }
        if byte[0] == b'\n' {
            return Ok(());
        }
    }
}

pub(super) fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    url.into_connection_info()
        .map_err(|e| Error::Config(format!("Redis URL: {e}")))
}

pub(super) fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    let redis = (&error as &dyn std::error::Error).downcast_ref::<redis::RedisError>();
    // A wrong password, a password missing, or a user without the right to a command.
    let refused = redis.is_some_and(|redis| {
        redis.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(redis.code(), Some("NOAUTH" | "NOPERM" | "WRONGPASS"))
    });
    if refused {
        return crate::refused_access(error);
    }
    crate::tls::broker_error(error)
}
