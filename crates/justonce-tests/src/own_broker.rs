//! A throwaway broker of a test's own, on its own ports and in its own temporary folder:
//! the one a test (or the fault harness's `broker-restart`) kills with SIGKILL and starts
//! again. The machine's shared brokers are never touched.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How long a broker may take to listen after it was started: RabbitMQ recovering its
/// queues after a SIGKILL takes the longest.
const STARTUP: Duration = Duration::from_secs(90);

/// A broker server of a test's own; killed, and its folder removed, when dropped.
pub struct OwnBroker {
    /// `amqp`, `nats`, `redis`, `mqtt` or `kafka`.
    kind: &'static str,
    folder: PathBuf,
    port: u16,
    /// RabbitMQ's distribution port, for the node's Erlang peers.
    dist_port: u16,
    running: Option<Child>,
    /// How often it was killed: a save after a kill is another process's.
    kills: Arc<AtomicU64>,
    /// Whether it requires a login, with [`OWN_PASSWORD`].
    login: bool,
}

/// The password a broker started with [`OwnBroker::start_with_login`] requires: the user
/// `justonce`'s on NATS and Mosquitto, the server's on Redis. RabbitMQ's `guest` keeps its
/// own, `guest`. Its `@`, `/` and `:` must be percent-encoded in a URL.
pub const OWN_PASSWORD: &str = "right@pass/wo:rd";

impl OwnBroker {
    /// Prepares the folder of broker `kind` and starts it.
    pub async fn start(kind: &str) -> Result<Self, String> {
        Self::launch(kind, false).await
    }

    /// [`OwnBroker::start`] with a broker that refuses a client without the right login.
    pub async fn start_with_login(kind: &str) -> Result<Self, String> {
        Self::launch(kind, true).await
    }

    async fn launch(kind: &str, login: bool) -> Result<Self, String> {
        let kind = ["amqp", "nats", "redis", "mqtt", "kafka"]
            .into_iter()
            .find(|known| *known == kind)
            .ok_or_else(|| format!("no broker of a test's own for {kind}"))?;
        let folder = std::env::temp_dir().join(format!("justonce-own-{kind}-{}", crate::unique()));
        std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        let ports = free_ports(2)?;
        let mut broker = Self {
            kind,
            folder,
            port: ports[0],
            dist_port: ports[1],
            running: None,
            kills: Arc::default(),
            login,
        };
        broker.configure()?;
        broker.start_again().await?;
        Ok(broker)
    }

    /// The URL clients reach it at, with the login it requires.
    pub fn url(&self) -> String {
        let password = if self.kind == "amqp" {
            "guest"
        } else {
            OWN_PASSWORD
        };
        self.url_with_password(password)
    }

    /// The URL with `password` in its login, percent-encoded: a login the broker refuses
    /// unless it is the right one. Without a login required, only RabbitMQ's URL has one.
    pub fn url_with_password(&self, password: &str) -> String {
        let port = self.port;
        let password = password
            .replace('%', "%25")
            .replace('@', "%40")
            .replace('/', "%2F")
            .replace(':', "%3A");
        match (self.kind, self.login) {
            ("amqp", _) => format!("amqp://guest:{password}@127.0.0.1:{port}/%2f"),
            (kind, false) => format!("{kind}://127.0.0.1:{port}"),
            ("redis", true) => format!("redis://:{password}@127.0.0.1:{port}"),
            (kind, true) => format!("{kind}://justonce:{password}@127.0.0.1:{port}"),
        }
    }

    /// The file of a broker that confirms a message before it saves it: Mosquitto's store,
    /// written at its autosaves. `None` where a confirm follows the write.
    pub fn saved_after_confirm(&self) -> Option<StoreFile> {
        (self.kind == "mqtt").then(|| StoreFile {
            path: self.folder.join("mosquitto.db"),
            kills: Arc::clone(&self.kills),
        })
    }

    /// Writes the configuration files the broker reads.
    fn configure(&self) -> Result<(), String> {
        let write = |name: &str, text: String| {
            let path = self.folder.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
        };
        match self.kind {
            "amqp" => {
                write("enabled_plugins", "[].\n".to_owned())?;
                // In place of the machine's environment file, which would name the machine
                // node: the node's Erlang peers are reached on this machine only.
                write(
                    "rabbitmq-env.conf",
                    "ERL_EPMD_ADDRESS=127.0.0.1\n".to_owned(),
                )?;
                write("advanced.config", "[].\n".to_owned())?;
                write(
                    "rabbitmq.conf",
                    format!("listeners.tcp.default = {}\n", self.port),
                )?;
                for folder in ["mnesia", "log"] {
                    let path = self.folder.join(folder);
                    std::fs::create_dir_all(&path)
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                }
                // The node runs as the rabbitmq user, with the machine node's Erlang cookie.
                let chown = std::process::Command::new("chown")
                    .args(["-R", "rabbitmq:rabbitmq"])
                    .arg(&self.folder)
                    .status()
                    .map_err(|e| format!("chown: {e}"))?;
                chown
                    .success()
                    .then_some(())
                    .ok_or_else(|| format!("cannot give {} to rabbitmq", self.folder.display()))
            }
            // Mosquitto writes its database at shutdown and at autosaves only: here after
            // every change, but after the PUBACK (see `saved_after_confirm`).
            "mqtt" => {
                let passwords = self.folder.join("passwords");
                let login = if self.login {
                    let made = std::process::Command::new("mosquitto_passwd")
                        .args(["-b", "-c"])
                        .arg(&passwords)
                        .args(["justonce", OWN_PASSWORD])
                        .status()
                        .map_err(|e| format!("mosquitto_passwd: {e}"))?;
                    if !made.success() {
                        return Err(format!("mosquitto_passwd exited with {made}"));
                    }
                    format!(
                        "allow_anonymous false\npassword_file {}\n",
                        passwords.display()
                    )
                } else {
                    "allow_anonymous true\n".to_owned()
                };
                write(
                    "mosquitto.conf",
                    format!(
                        "listener {} 127.0.0.1\n{login}persistence true\n\
                         persistence_location {}/\nautosave_interval 1\n\
                         autosave_on_changes true\nmax_queued_messages 0\nuser root\n",
                        self.port,
                        self.folder.display()
                    ),
                )
            }
            _ => Ok(()),
        }
    }

    /// The command that runs the broker in the foreground.
    fn command(&self) -> Result<Command, String> {
        let folder = self.folder.display().to_string();
        let port = self.port.to_string();
        let mut command = match self.kind {
            "amqp" => {
                let mut command = Command::new("rabbitmq-server");
                let file = |name: &str| self.folder.join(name);
                command
                    .env("RABBITMQ_NODENAME", format!("{}@localhost", self.node()))
                    .env("RABBITMQ_NODE_PORT", &port)
                    .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
                    .env("RABBITMQ_MNESIA_BASE", file("mnesia"))
                    .env("RABBITMQ_LOG_BASE", file("log"))
                    .env("RABBITMQ_CONFIG_FILE", file("rabbitmq.conf"))
                    .env("RABBITMQ_CONF_ENV_FILE", file("rabbitmq-env.conf"))
                    .env("RABBITMQ_ADVANCED_CONFIG_FILE", file("advanced.config"))
                    .env("RABBITMQ_ENABLED_PLUGINS_FILE", file("enabled_plugins"))
                    .env("RABBITMQ_PID_FILE", file("beam.pid"));
                command
            }
            "nats" => {
                let mut command = Command::new("nats-server");
                command.args(["-a", "127.0.0.1", "-p", &port, "-js", "-sd", &folder]);
                if self.login {
                    command.args(["--user", "justonce", "--pass", OWN_PASSWORD]);
                }
                command
            }
            // The Kafka-protocol test broker keeps its topics in memory: a restart loses them.
            "kafka" => nisshi_broker(&self.folder, "memory://", self.port, self.port)?.into(),
            "redis" => {
                let mut command = Command::new("redis-server");
                command.args([
                    "--port",
                    &port,
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    &folder,
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    "--save",
                    "",
                ]);
                if self.login {
                    command.args(["--requirepass", OWN_PASSWORD]);
                }
                command
            }
            _ => {
                let mut command = Command::new("mosquitto");
                command.arg("-c").arg(self.folder.join("mosquitto.conf"));
                command
            }
        };
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        Ok(command)
    }

    /// The RabbitMQ node's name, unique to the folder.
    fn node(&self) -> String {
        let name = self.folder.file_name().unwrap_or_default();
        name.to_string_lossy().replace('-', "_")
    }

    /// Starts the broker and returns once it listens.
    pub async fn start_again(&mut self) -> Result<(), String> {
        let child = self
            .command()?
            .spawn()
            .map_err(|e| format!("cannot start the {} broker: {e}", self.kind))?;
        self.running = Some(child);
        let given_up = Instant::now() + STARTUP;
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Some(child) = &mut self.running
                && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
            {
                return Err(format!("the {} broker exited: {status}", self.kind));
            }
            if Instant::now() >= given_up {
                return Err(format!("the {} broker did not listen in time", self.kind));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILLs the broker and waits until it is gone.
    pub async fn kill(&mut self) -> Result<(), String> {
        // Counted before the kill: whoever sees a save and then this count unchanged saw
        // the killed process's save.
        self.kills.fetch_add(1, Ordering::SeqCst);
        if self.kind == "amqp" {
            kill_node(&self.folder.join("beam.pid")).await;
        }
        if let Some(mut child) = self.running.take() {
            child
                .kill()
                .await
                .map_err(|e| format!("cannot kill the {} broker: {e}", self.kind))?;
        }
        Ok(())
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        if let Some((_, group)) = node_process(&self.folder.join("beam.pid")) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .status();
        }
        if let Some(child) = &mut self.running {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// A store a broker writes whole at each save, to a new file renamed over the last.
#[derive(Clone)]
pub struct StoreFile {
    path: PathBuf,
    kills: Arc<AtomicU64>,
}

/// The broker process a confirm came from: taken before publishing.
#[derive(Clone, Copy)]
pub struct Publishing(u64);

impl StoreFile {
    /// Taken before publishing, for [`StoreFile::saved_again`].
    pub fn publishing(&self) -> Publishing {
        Publishing(self.kills.load(Ordering::SeqCst))
    }

    /// Waits up to `wait` for a save that begins after now, by the process that took what
    /// was published since `publishing`; whether one came. Mosquitto handles packets and
    /// saves in one thread, so its save seen after a confirm arrived began after the
    /// confirm was sent: it holds the message, or the consumer's acknowledgement of it. A
    /// broker killed meanwhile may have lost it: a save of the restarted one proves nothing.
    pub async fn saved_again(&self, publishing: Publishing, wait: Duration) -> bool {
        let now = self.save();
        let given_up = Instant::now() + wait;
        while Instant::now() < given_up {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if self.save() != now {
                return self.kills.load(Ordering::SeqCst) == publishing.0;
            }
        }
        false
    }

    /// Which save the file holds: its inode and time of writing (an inode alone may be
    /// handed out again two saves later).
    fn save(&self) -> Option<(u64, std::time::SystemTime)> {
        use std::os::unix::fs::MetadataExt;
        let metadata = std::fs::metadata(&self.path).ok()?;
        Some((metadata.ino(), metadata.modified().ok()?))
    }
}

/// SIGKILLs the RabbitMQ node whose process id is in `pid_file`, with the scripts that
/// started it: `su` runs them in a session of their own, so their process group goes. Waits
/// until the node is gone.
async fn kill_node(pid_file: &Path) {
    let Some((pid, group)) = node_process(pid_file) else {
        return;
    };
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .status()
        .await;
    let given_up = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < given_up {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The next start writes its own; a stale one must never name another process.
    let _ = std::fs::remove_file(pid_file);
}

/// The process id in `pid_file` and its process group, if it runs.
fn node_process(pid_file: &Path) -> Option<(u32, u32)> {
    let pid: u32 = std::fs::read_to_string(pid_file)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let group = process_status(pid)?.get(2)?.parse().ok()?;
    Some((pid, group))
}

/// What Linux says of process `pid` after its command name: its state (`T` when stopped),
/// its parent, its process group, and so on; `None` once it is gone.
pub fn process_status(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: the fields follow the last one.
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// `count` distinct ports nothing listens on now: each is held until all are chosen, so
/// that none is handed out twice.
pub(crate) fn free_ports(count: usize) -> Result<Vec<u16>, String> {
    let listeners = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    listeners
        .iter()
        .map(|listener| Ok(listener.local_addr().map_err(|e| e.to_string())?.port()))
        .collect()
}

/// The command that runs the Kafka-protocol test broker in `folder`, with its data in
/// `storage`, listening on `port` and telling clients to connect to `advertised`. It reads
/// a `.env` in its working directory: `folder` has none.
pub(crate) fn nisshi_broker(
    folder: &Path,
    storage: &str,
    port: u16,
    advertised: u16,
) -> Result<std::process::Command, String> {
    let mut command = std::process::Command::new(nisshi()?);
    command.current_dir(folder).args([
        "broker",
        "--storage-engine",
        storage,
        "--listener-url",
        &format!("tcp://127.0.0.1:{port}"),
        "--advertised-listener-url",
        &format!("tcp://127.0.0.1:{advertised}"),
        "--cluster-id",
        "justonce-own",
    ]);
    Ok(command)
}

/// The Kafka-protocol test broker, where `scripts/services` installs it.
pub(crate) fn nisshi() -> Result<PathBuf, String> {
    let home = std::env::var_os("HOME").ok_or("HOME is not set: cannot find nisshi")?;
    let path = Path::new(&home).join(".cache/justonce/nisshi-0.6.0-libsql/bin/nisshi");
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the Kafka test broker is not installed at {}: run scripts/services",
            path.display()
        ))
    }
}
