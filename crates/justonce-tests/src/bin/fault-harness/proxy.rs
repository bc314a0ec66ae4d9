//! A TCP proxy between the workers and PostgreSQL or MariaDB that cuts connections at
//! COMMIT: after
//! forwarding it (the server commits, the client never hears so) or before (the server
//! rolls back). Some cuts open an outage: every connection is broken and new ones are
//! refused for a while, longer than a worker tries to resolve its commit.

use crate::Rng;
use crate::broker::key_index;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// sqlx sends COMMIT to PostgreSQL as a simple query: `Q`, the length (4 + 7) and the text
/// with its NUL.
pub const POSTGRES_COMMIT: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";

/// sqlx sends COMMIT to MariaDB as a text query: the payload's length (3 bytes), the
/// sequence number 0, `COM_QUERY` and the text.
pub const MYSQL_COMMIT: &[u8] = b"\x07\0\0\0\x03COMMIT";

/// One cut: the key whose transaction it was, and whether COMMIT reached the server.
#[derive(Clone, Copy)]
pub struct Cut {
    pub key: Option<u32>,
    pub forwarded: bool,
}

/// When to cut, and how.
pub struct Plan {
    /// Cuts in all; each COMMIT is cut with a chance of one in `one_in` until they are made.
    pub cuts: usize,
    pub one_in: u64,
    /// Every `outage_every`-th cut opens an outage of `outage`.
    pub outage_every: usize,
    pub outage: Duration,
}

struct State {
    plan: Plan,
    /// The bytes of a COMMIT in the server's protocol.
    commit: &'static [u8],
    rng: Rng,
    cuts: Vec<Cut>,
    refuse_until: Option<Instant>,
}

/// A running proxy: its port, and the cuts it made.
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<State>>,
}

impl Proxy {
    /// Listens on a free port and forwards to `upstream` (`host:port`), watching for
    /// `commit`. Each outage is sent to `faults` as (began, ended).
    pub async fn start(
        upstream: String,
        commit: &'static [u8],
        plan: Plan,
        rng: Rng,
        faults: mpsc::UnboundedSender<(Instant, Instant)>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(Mutex::new(State {
            plan,
            commit,
            rng,
            cuts: Vec::new(),
            refuse_until: None,
        }));
        // Each outage moves the epoch on; every connection of an older epoch closes.
        let (epoch, _) = watch::channel(0u64);
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let refused = shared
                    .lock()
                    .expect("proxy state")
                    .refuse_until
                    .is_some_and(|until| Instant::now() < until);
                if refused {
                    continue; // dropping `client` closes it
                }
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let connection = Connection {
                    state: Arc::clone(&shared),
                    epoch: epoch.clone(),
                    faults: faults.clone(),
                };
                tokio::spawn(connection.relay(client, server));
            }
        });
        Ok(Self { port, state })
    }

    /// The cuts made so far.
    pub fn cuts(&self) -> Vec<Cut> {
        self.state.lock().expect("proxy state").cuts.clone()
    }
}

struct Connection {
    state: Arc<Mutex<State>>,
    epoch: watch::Sender<u64>,
    faults: mpsc::UnboundedSender<(Instant, Instant)>,
}

impl Connection {
    async fn relay(self, client: TcpStream, server: TcpStream) {
        let mut outage = self.epoch.subscribe();
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        // Set when COMMIT was forwarded and its answer must not reach the client.
        let (silence, mut silenced) = watch::channel(false);
        let answers = async move {
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let read = from_server.read(&mut buffer).await.unwrap_or(0);
                if read == 0 || *silenced.borrow_and_update() {
                    return;
                }
                if to_client.write_all(&buffer[..read]).await.is_err() {
                    return;
                }
            }
        };
        let commit = self.state.lock().expect("proxy state").commit;
        let requests = async move {
            let mut buffer = vec![0; 64 * 1024];
            // The last workload key this connection sent: the key of its transaction.
            let mut key = None;
            loop {
                let read = from_client.read(&mut buffer).await.unwrap_or(0);
                if read == 0 {
                    return;
                }
                let chunk = &buffer[..read];
                key = last_key(chunk).or(key);
                if chunk.windows(commit.len()).any(|w| w == commit)
                    && let Some(forward) = self.decide(key)
                {
                    if forward {
                        silence.send_replace(true);
                        let _ = to_server.write_all(chunk).await;
                        // Keep the server's side open until its answer, proof of the
                        // commit, has been read and dropped.
                        std::future::pending::<()>().await;
                    }
                    return;
                }
                if to_server.write_all(chunk).await.is_err() {
                    return;
                }
            }
        };
        // Whichever ends first ends the connection: both sockets are dropped.
        tokio::select! {
            () = answers => {}
            () = requests => {}
            _ = outage.changed() => {}
        }
    }

    /// Whether to cut this COMMIT: `Some(true)` to forward it first, `Some(false)` to drop
    /// it. An outage cut also breaks every other connection and refuses new ones. A key is cut
    /// once at most, so that each cut's resolution can be told.
    fn decide(&self, key: Option<u32>) -> Option<bool> {
        let mut state = self.state.lock().expect("proxy state");
        let state = &mut *state;
        let cut_before = state.cuts.iter().any(|cut| key.is_some() && cut.key == key);
        if cut_before
            || state.cuts.len() >= state.plan.cuts
            || state.rng.below(state.plan.one_in) != 0
        {
            return None;
        }
        let forwarded = state.rng.below(2) == 0;
        state.cuts.push(Cut { key, forwarded });
        if state.cuts.len().is_multiple_of(state.plan.outage_every) {
            let began = Instant::now();
            let ended = began + state.plan.outage;
            state.refuse_until = Some(ended);
            self.epoch.send_modify(|epoch| *epoch += 1);
            let _ = self.faults.send((began, ended));
        }
        Some(forwarded)
    }
}

/// The last workload key (`key-` and seven digits) in `bytes`.
fn last_key(bytes: &[u8]) -> Option<u32> {
    const LENGTH: usize = "key-0000000".len();
    bytes
        .windows(LENGTH)
        .rev()
        .filter(|window| window.starts_with(b"key-"))
        .find_map(|window| key_index(std::str::from_utf8(window).ok()?))
}
