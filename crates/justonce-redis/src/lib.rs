//! Leases for [justonce](https://docs.rs/justonce) on Redis: keys held for work outside a
//! database transaction, and the Idempotency-Key layer's keys, with fencing tokens and
//! expiry judged by the Redis server's clock.
//!
//! ```no_run
//! # async fn example() -> Result<(), justonce_core::Error> {
//! use justonce_core::{Consumer, Fingerprint, Identity, Key, LeaseClaim, Leases, Retention, Scope};
//! use justonce_redis::RedisLeases;
//! use std::time::Duration;
//!
//! let leases = RedisLeases::connect("redis://127.0.0.1:6379", Retention::default()).await?;
//! let identity = Identity::new(Scope::none(), Consumer::new("mailer")?, Key::new("welcome:u_1")?);
//! if let LeaseClaim::Acquired(lease) = leases
//!     .claim_lease(&identity, &Fingerprint::of("u_1"), Duration::from_secs(30))
//!     .await?
//! {
//!     // send the email here
//!     leases.complete(&lease, b"sent").await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Feature flags
//!
//! None: TLS (rustls with *ring*) is always built in.
//!
//! # TLS
//!
//! A `rediss://` URL connects over TLS, checked against the system's roots;
//! [`RedisLeases::connect_tls`] takes a CA and a client certificate.
//!
//! # Durability
//!
//! A lease here is only as durable as the Redis server's persistence. A server that
//! restarts without its data (no AOF or RDB, or a failover to a replica that had not
//! received the latest writes) forgets completed keys, and their work runs again. Keep
//! keys whose loss would double an effect in the SQL store, in the same transaction as
//! the effect; use Redis where a rare second run is acceptable or the effect is itself
//! idempotent.
//!
//! # Layout
//!
//! Each key is one Redis string, kept for the retention as its TTL:
//! `{prefix}{scope length}:{scope}{consumer length}:{consumer}{key}`. Its value holds the
//! state, the payload's fingerprint, the fencing token, the lease's end and the result.

#![cfg_attr(docsrs, feature(doc_cfg))]

use justonce_core::{
    Error, Fingerprint, Identity, Lease, LeaseClaim, LeaseFuture, Leases, Retention,
};
use redis::aio::ConnectionManager;
pub use redis::{ClientTlsConfig, TlsCertificates};
use std::sync::LazyLock;
use std::time::Duration;

/// A lease store on one Redis server (or one primary).
#[derive(Clone)]
pub struct RedisLeases {
    connection: ConnectionManager,
    prefix: String,
    keep_ms: u64,
}

impl std::fmt::Debug for RedisLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeases")
            .field("prefix", &self.prefix)
            .field("keep_ms", &self.keep_ms)
            .finish_non_exhaustive()
    }
}

impl RedisLeases {
    /// The prefix of every Redis key written, unless [`RedisLeases::prefix`] sets another.
    pub const DEFAULT_PREFIX: &'static str = "justonce:";

    /// Connects to `url` (`redis://host:port/db`, or `rediss://` over TLS), keeping each
    /// key for `retention`'s [`keep`](Retention::keep) after it was taken or completed. The
    /// connection is re-established on its own after a failure.
    pub async fn connect(url: &str, retention: Retention) -> Result<Self, Error> {
        let client = redis::Client::open(url)
            .map_err(|e| Error::Config(format!("Redis URL {url:?}: {e}")))?;
        Self::open(client, retention).await
    }

    /// Connects to `url` (`rediss://host:port/db`) over TLS, trusting the CAs of
    /// `certificates` instead of the system's and presenting its client certificate, if
    /// any; otherwise as [`RedisLeases::connect`].
    pub async fn connect_tls(
        url: &str,
        certificates: TlsCertificates,
        retention: Retention,
    ) -> Result<Self, Error> {
        let client = redis::Client::build_with_tls(url, certificates)
            .map_err(|e| Error::Config(format!("Redis TLS settings: {e}")))?;
        Self::open(client, retention).await
    }

    async fn open(client: redis::Client, retention: Retention) -> Result<Self, Error> {
        // redis builds its TLS configuration with the process's default provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let connection = client.get_connection_manager().await.map_err(redis_error)?;
        Ok(Self {
            connection,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            keep_ms: millis(retention.keep()),
        })
    }

    /// Writes keys under `prefix` instead of `justonce:`, to keep applications apart on
    /// one server.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key that holds `identity`; lengths keep any scope and consumer apart.
    fn redis_key(&self, identity: &Identity) -> String {
        let (scope, consumer) = (identity.scope.as_str(), identity.consumer.as_str());
        format!(
            "{}{}:{scope}{}:{consumer}{}",
            self.prefix,
            scope.len(),
            consumer.len(),
            identity.key.as_str()
        )
    }

    async fn take(
        &self,
        identity: &Identity,
        fingerprint: &Fingerprint,
        lease_for: Duration,
    ) -> Result<LeaseClaim, Error> {
        let mut connection = self.connection.clone();
        let answer: Vec<redis::Value> = CLAIM
            .key(self.redis_key(identity))
            .arg(fingerprint.as_bytes().as_slice())
            .arg(millis(lease_for))
            .arg(self.keep_ms)
            .invoke_async(&mut connection)
            .await
            .map_err(redis_error)?;
        let unexpected =
            || Error::Schema(format!("unexpected answer to a lease claim: {answer:?}"));
        let (Some(redis::Value::Int(state)), Some(value)) = (answer.first(), answer.get(1)) else {
            return Err(unexpected());
        };
        match (state, value) {
            (1, redis::Value::Int(token)) => {
                if *token > 1 {
                    metrics::counter!("justonce_lease_takeovers_total").increment(1);
                }
                Ok(LeaseClaim::Acquired(Lease {
                    identity: identity.clone(),
                    token: *token,
                }))
            }
            (2, redis::Value::BulkString(result)) => Ok(LeaseClaim::Done {
                result: Some(result.clone()),
            }),
            (3, redis::Value::Int(remaining_ms)) => Ok(LeaseClaim::InProgress {
                remaining: Duration::from_millis(remaining_ms.unsigned_abs()),
            }),
            (4, redis::Value::BulkString(stored)) => {
                let stored: [u8; 32] = stored.as_slice().try_into().map_err(|_| unexpected())?;
                Ok(LeaseClaim::KeyReused {
                    stored: Fingerprint::from_bytes(stored),
                    received: *fingerprint,
                })
            }
            _ => Err(unexpected()),
        }
    }

    /// Runs a script that changes a held lease; 0 means another holder has the key.
    async fn change(&self, lease: &Lease, script: &redis::Script, arg: &[u8]) -> Result<(), Error> {
        let mut connection = self.connection.clone();
        let changed: i64 = script
            .key(self.redis_key(&lease.identity))
            .arg(token_text(lease.token))
            .arg(arg)
            .arg(self.keep_ms)
            .invoke_async(&mut connection)
            .await
            .map_err(redis_error)?;
        if changed == 0 {
            return Err(lease.lost());
        }
        Ok(())
    }
}

impl Leases for RedisLeases {
    fn claim_lease<'a>(
        &'a self,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_for: Duration,
    ) -> LeaseFuture<'a, LeaseClaim> {
        Box::pin(self.take(identity, fingerprint, lease_for))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, result: &'a [u8]) -> LeaseFuture<'a, ()> {
        Box::pin(self.change(lease, &COMPLETE, result))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> LeaseFuture<'a, ()> {
        Box::pin(self.change(lease, &RELEASE, b""))
    }

    fn renew<'a>(&'a self, lease: &'a Lease, lease_for: Duration) -> LeaseFuture<'a, ()> {
        let lease_ms = millis(lease_for).to_string().into_bytes();
        Box::pin(async move { self.change(lease, &RENEW, &lease_ms).await })
    }
}

/// The value of a key: one state byte (`L` held, `D` done), the 32-byte fingerprint, the
/// token in 20 digits, the lease's end in 15 digits of Unix milliseconds by the server's
/// clock, then the result. Every script reads the clock with `TIME`, never the caller's.
const PRELUDE: &str = r"
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local current = redis.call('GET', KEYS[1])
local function record(state, fingerprint, token, ends, result)
  return state .. fingerprint .. string.format('%020d', token) .. string.format('%015d', ends) .. result
end
";

/// Checks that `ARGV[1]` is the token of a lease still held on the key; returns early
/// with 0 otherwise.
const HELD: &str = r"
if not current or string.sub(current, 1, 1) ~= 'L' or string.sub(current, 34, 53) ~= ARGV[1] then
  return 0
end
local fingerprint, token = string.sub(current, 2, 33), tonumber(string.sub(current, 34, 53))
";

/// `ARGV`: fingerprint, lease milliseconds, retention milliseconds. Answers `{1, token}`
/// acquired, `{2, result}` done, `{3, remaining ms}` held, `{4, fingerprint}` reused.
static CLAIM: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{PRELUDE}
local keep = math.max(tonumber(ARGV[3]), tonumber(ARGV[2]))
if not current then
  redis.call('SET', KEYS[1], record('L', ARGV[1], 1, now + ARGV[2], ''), 'NX', 'PX', keep)
  return {{1, 1}}
end
if string.sub(current, 2, 33) ~= ARGV[1] then return {{4, string.sub(current, 2, 33)}} end
if string.sub(current, 1, 1) == 'D' then return {{2, string.sub(current, 69)}} end
local ends = tonumber(string.sub(current, 54, 68))
if ends > now then return {{3, ends - now}} end
local token = tonumber(string.sub(current, 34, 53)) + 1
redis.call('SET', KEYS[1], record('L', ARGV[1], token, now + ARGV[2], ''), 'PX', keep)
return {{1, token}}
"
    ))
});

/// `ARGV`: token, result, retention milliseconds.
static COMPLETE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{PRELUDE}{HELD}
redis.call('SET', KEYS[1], record('D', fingerprint, token, 0, ARGV[2]), 'PX', ARGV[3])
return 1
"
    ))
});

/// `ARGV`: token. The key stays, expired, so that the next holder's token is larger.
static RELEASE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{PRELUDE}{HELD}
redis.call('SET', KEYS[1], record('L', fingerprint, token, now, ''), 'KEEPTTL')
return 1
"
    ))
});

/// `ARGV`: token, lease milliseconds.
static RENEW: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{PRELUDE}{HELD}
local lease = tonumber(ARGV[2])
redis.call('SET', KEYS[1], record('L', fingerprint, token, now + lease, ''), 'KEEPTTL')
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 1
"
    ))
});

fn token_text(token: i64) -> String {
    format!("{token:020}")
}

/// A duration in whole milliseconds, at most 100 years.
fn millis(duration: Duration) -> u64 {
    const HUNDRED_YEARS_MS: u128 = 100 * 365 * 86_400 * 1_000;
    duration.as_millis().min(HUNDRED_YEARS_MS) as u64
}

fn redis_error(error: redis::RedisError) -> Error {
    let retryable = error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal();
    Error::database(retryable, error)
}
