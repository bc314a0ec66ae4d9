//! The libpq multi-host URL (`postgres://h1:5432,h2:5433/app?target_session_attrs=read-write`):
//! the pool connects to the first host that accepts writes, and moves to the next one
//! when that host dies or turns read-only.
//!
//! sqlx's options name one host. The pool is opened on the host found writable; a
//! watcher keeps a connection of its own to that host, checks it every second, and on a
//! failure tries the hosts again in the URL's order and points the pool at the first one
//! that accepts writes. Connections opened before that switch are closed instead of
//! being handed out, and a new connection to a server that refuses writes is dropped.

use super::tls::TLS;
use crate::backend::Watcher;
use crate::shared::driver_error;
use crate::tls::Target;
use justonce_core::Error;
use sqlx::pool::{Pool, PoolOptions};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Postgres};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the watcher checks the host the pool writes to.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// The longest a probe waits for one host to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between rounds over the hosts while none accepts writes at start.
const ROUND_PAUSE: Duration = Duration::from_millis(250);

/// Which server of the list a session settles on: libpq's `target_session_attrs`, as far as
/// a store that writes can use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SessionAttrs {
    /// The first server that answers.
    Any,
    /// The first server whose sessions accept writes (`transaction_read_only` off).
    ReadWrite,
    /// The first server that is not in recovery.
    Primary,
}

impl SessionAttrs {
    fn parse(value: &str) -> Result<Self, Error> {
        match value {
            "any" => Ok(Self::Any),
            "read-write" => Ok(Self::ReadWrite),
            "primary" => Ok(Self::Primary),
            "read-only" | "standby" | "prefer-standby" => Err(Error::Config(format!(
                "target_session_attrs={value} chooses a server that refuses writes, and justonce \
                 writes every claim; write read-write (the default) or primary"
            ))),
            other => Err(Error::Config(format!(
                "target_session_attrs={other} is not a value libpq knows; write read-write \
                 (the default), primary or any"
            ))),
        }
    }

    /// Whether the server on `conn` is one these attributes accept.
    async fn accepts(self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let (in_recovery, read_only): (bool, String) =
            sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
                .fetch_one(conn)
                .await?;
        Ok(match self {
            Self::Any => true,
            Self::ReadWrite => read_only == "off",
            Self::Primary => !in_recovery,
        })
    }
}

/// The hosts of a multi-host URL, in order, and what a session needs of its server.
pub(super) struct Hosts {
    targets: Vec<Target<PgConnectOptions>>,
    attrs: SessionAttrs,
}

impl Hosts {
    /// The hosts of `url` if it names several or sets `target_session_attrs`; `None` for a
    /// plain one-host URL, which the driver reads as it is.
    pub(super) fn parse(url: &str) -> Result<Option<Self>, Error> {
        let Some((urls, attrs)) = split(url)? else {
            return Ok(None);
        };
        let targets = urls
            .iter()
            .map(|url| Target::parse(url, &TLS))
            .collect::<Result<_, _>>()?;
        Ok(Some(Self { targets, attrs }))
    }

    /// `host:port` of the `index`th host, as log lines name it.
    fn named(&self, index: usize) -> String {
        let options = &self.targets[index].options;
        format!("{}:{}", options.get_host(), options.get_port())
    }

    /// The first host, in the URL's order, whose server these attributes accept, with a
    /// connection to it; or each host's problem.
    async fn find(&self) -> Result<(usize, PgConnection), Vec<Error>> {
        let mut problems = Vec::with_capacity(self.targets.len());
        for (index, target) in self.targets.iter().enumerate() {
            let problem = match self.probe(target).await {
                Ok(conn) => return Ok((index, conn)),
                Err(problem) => problem,
            };
            problems.push(problem);
        }
        Err(problems)
    }

    async fn probe(&self, target: &Target<PgConnectOptions>) -> Result<PgConnection, Error> {
        let named = |problem: String| {
            let options = &target.options;
            Error::database(
                true,
                format!("{}:{}: {problem}", options.get_host(), options.get_port()),
            )
        };
        let connected = tokio::time::timeout(PROBE_TIMEOUT, async {
            let mut conn = PgConnection::connect_with(&target.options).await?;
            let accepted = self.attrs.accepts(&mut conn).await?;
            Ok::<_, sqlx::Error>((conn, accepted))
        })
        .await;
        match connected {
            Ok(Ok((conn, true))) => Ok(conn),
            Ok(Ok((conn, false))) => {
                let _ = conn.close().await;
                Err(named(self.refusal().to_owned()))
            }
            Ok(Err(error)) => match target.connect_error(error, driver_error::<Postgres>) {
                config @ Error::Config(_) => Err(config),
                other => Err(named(other.to_string())),
            },
            Err(_) => Err(named(format!(
                "no answer within {} s",
                PROBE_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Why a server that answered is not taken.
    fn refusal(&self) -> &'static str {
        match self.attrs {
            SessionAttrs::Primary => "the server is a standby (in recovery)",
            _ => "the server accepts no writes (transaction_read_only is on)",
        }
    }
}

/// A one-host URL for each host of `url`, in order, without `target_session_attrs`, and
/// what that parameter asks; `None` for a plain one-host URL. Reads no file and connects
/// nowhere.
pub(super) fn split(url: &str) -> Result<Option<(Vec<String>, SessionAttrs)>, Error> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(None);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, host_list) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    let mut attrs = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("target_session_attrs=") {
            Some(value) => {
                attrs = Some(value);
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    if attrs.is_none() && !host_list.contains(',') {
        return Ok(None);
    }
    let attrs = attrs.map_or(Ok(SessionAttrs::ReadWrite), SessionAttrs::parse)?;
    if attrs == SessionAttrs::Any && host_list.contains(',') {
        // The first host that answers may be a standby, and every write would then fail.
        return Err(Error::Config(
            "target_session_attrs=any with several hosts may choose a standby, which refuses \
             every write; write read-write (the default) or primary"
                .to_owned(),
        ));
    }
    let query = match kept.is_empty() {
        true => String::new(),
        false => format!("?{}", kept.join("&")),
    };
    let urls = host_list
        .split(',')
        .map(|host| match host.is_empty() {
            true => Err(Error::Config(format!(
                "the PostgreSQL URL's host list {host_list:?} has an empty entry"
            ))),
            false => Ok(format!("{scheme}://{userinfo}{host}{path}{query}")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Some((urls, attrs)))
}

/// What the pool's hooks and the watcher share.
struct Failover {
    hosts: Hosts,
    /// When the pool was last pointed at another host.
    switched: Mutex<Instant>,
    /// Wakes the watcher early: a new connection found its server refusing writes.
    suspect: tokio::sync::Notify,
}

impl Failover {
    fn since_switch(&self) -> Duration {
        self.switched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed()
    }
}

/// Opens a pool on the first of `hosts` that accepts writes, trying them all again until
/// the pool's acquire timeout, and starts its watcher, which runs until the pool is closed
/// or the returned handle is dropped.
pub(super) async fn connect(
    hosts: Hosts,
    pool: PoolOptions<Postgres>,
) -> Result<(Pool<Postgres>, Watcher), Error> {
    let deadline = Instant::now() + pool.get_acquire_timeout();
    let (current, sentinel) = loop {
        match hosts.find().await {
            Ok(found) => break found,
            Err(problems) => {
                if let Some(config) = problems.iter().find(|p| matches!(p, Error::Config(_))) {
                    return Err(Error::Config(config.to_string()));
                }
                if Instant::now() >= deadline {
                    return Err(no_host(&hosts, &problems));
                }
            }
        }
        tokio::time::sleep(ROUND_PAUSE).await;
    };
    let failover = Arc::new(Failover {
        hosts,
        switched: Mutex::new(Instant::now()),
        suspect: tokio::sync::Notify::new(),
    });
    let on_connect = Arc::clone(&failover);
    let on_acquire = Arc::clone(&failover);
    let pool = pool
        .after_connect(move |conn, _| {
            let failover = Arc::clone(&on_connect);
            Box::pin(async move {
                if failover.hosts.attrs.accepts(conn).await? {
                    return Ok(());
                }
                failover.suspect.notify_one();
                Err(sqlx::Error::Protocol(failover.hosts.refusal().to_owned()))
            })
        })
        .before_acquire(move |conn, meta| {
            // A connection older than the last switch may be to the old primary.
            let current = meta.age < on_acquire.since_switch();
            Box::pin(
                async move { Ok(current && crate::pool::answers_unless_beginning(conn).await?) },
            )
        });
    let pool = failover.hosts.targets[current]
        .connect_pool(pool, driver_error::<Postgres>)
        .await?;
    tracing::info!(host = %failover.hosts.named(current), "connected to the host that accepts writes");
    let watcher = tokio::spawn(watch(pool.clone(), failover, current, sentinel));
    Ok((pool, Watcher(watcher.abort_handle())))
}

/// Checks the host the pool writes to every second (or at once when a new connection found
/// its server refusing writes) on a connection of its own, and on a failure points the pool
/// at the first host that accepts writes.
async fn watch(
    pool: Pool<Postgres>,
    failover: Arc<Failover>,
    mut current: usize,
    sentinel: PgConnection,
) {
    let hosts = &failover.hosts;
    let mut sentinel = Some(sentinel);
    let mut lost_logged = false;
    let closed = pool.close_event();
    tokio::pin!(closed);
    loop {
        tokio::select! {
            () = &mut closed => return,
            () = failover.suspect.notified() => {}
            () = tokio::time::sleep(WATCH_INTERVAL) => {}
        }
        // Bounded: a host that vanished (power, network) answers nothing, not even a reset.
        if let Some(conn) = &mut sentinel
            && matches!(
                tokio::time::timeout(PROBE_TIMEOUT, hosts.attrs.accepts(conn)).await,
                Ok(Ok(true))
            )
        {
            continue;
        }
        sentinel = None;
        match hosts.find().await {
            Ok((found, conn)) => {
                sentinel = Some(conn);
                lost_logged = false;
                if found != current {
                    pool.set_connect_options(hosts.targets[found].options.clone());
                    *failover
                        .switched
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
                    tracing::warn!(
                        from = %hosts.named(current),
                        to = %hosts.named(found),
                        "the database failed over: writing to another host"
                    );
                    current = found;
                }
            }
            Err(problems) if !lost_logged => {
                lost_logged = true;
                tracing::error!(error = %no_host(hosts, &problems), "no database host accepts writes");
            }
            Err(_) => {}
        }
    }
}

/// The error of a host list none of whose servers could be used, with each one's problem.
fn no_host(hosts: &Hosts, problems: &[Error]) -> Error {
    let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
    Error::database(
        true,
        format!(
            "none of the {} PostgreSQL hosts accepts a session with target_session_attrs={}: {}",
            hosts.targets.len(),
            match hosts.attrs {
                SessionAttrs::Any => "any",
                SessionAttrs::ReadWrite => "read-write",
                SessionAttrs::Primary => "primary",
            },
            problems.join("; ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(url: &str) -> Hosts {
        Hosts::parse(url).unwrap().expect("a multi-host URL")
    }

    fn config_error(url: &str) -> String {
        match Hosts::parse(url) {
            Err(Error::Config(message)) => message,
            Err(other) => panic!("{url}: {other}"),
            Ok(_) => panic!("{url} was accepted"),
        }
    }

    #[test]
    fn a_host_list_is_one_target_per_host_in_order_with_the_rest_of_the_url() {
        let list =
            hosts("postgres://app:pw@127.0.0.1:5432,localhost:5433,[::1]/db?sslmode=disable");
        assert_eq!(list.attrs, SessionAttrs::ReadWrite);
        let named: Vec<String> = (0..3).map(|i| list.named(i)).collect();
        assert_eq!(named, ["127.0.0.1:5432", "localhost:5433", "[::1]:5432"]);
        for target in &list.targets {
            assert_eq!(target.options.get_database(), Some("db"));
            assert_eq!(target.options.get_username(), "app");
        }
    }

    #[test]
    fn target_session_attrs_is_read_and_removed() {
        let list = hosts("postgres://127.0.0.1:1,127.0.0.1:2/db?target_session_attrs=primary");
        assert_eq!(list.attrs, SessionAttrs::Primary);
        let one = hosts("postgres://127.0.0.1/db?target_session_attrs=any&application_name=x");
        assert_eq!(one.attrs, SessionAttrs::Any);
        assert_eq!(one.targets.len(), 1);
        assert_eq!(one.targets[0].options.get_application_name(), Some("x"));
    }

    #[test]
    fn a_plain_url_is_left_to_the_driver() {
        for url in [
            "postgres://app@127.0.0.1:5432/db",
            "postgres:///db?host=/var/run/postgresql",
            "postgres://127.0.0.1/db?sslmode=disable",
        ] {
            assert!(Hosts::parse(url).unwrap().is_none(), "{url}");
        }
    }

    #[test]
    fn sessions_that_refuse_writes_and_unknown_values_are_configuration_errors() {
        for value in ["read-only", "standby", "prefer-standby"] {
            let message =
                config_error(&format!("postgres://h1,h2/db?target_session_attrs={value}"));
            assert!(message.contains("refuses writes"), "{message}");
        }
        let message = config_error("postgres://h1,h2/db?target_session_attrs=any");
        assert!(message.contains("may choose a standby"), "{message}");
        let message = config_error("postgres://h1,h2/db?target_session_attrs=leader");
        assert!(message.contains("not a value libpq knows"), "{message}");
        let message = config_error("postgres://h1,,h2/db");
        assert!(message.contains("empty entry"), "{message}");
    }
}
