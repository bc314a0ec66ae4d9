//! Throwaway brokers of a test's own, listening only over TLS with a certificate of a
//! [`TestCa`]: Redis, Mosquitto, NATS JetStream, a RabbitMQ node and the Kafka-protocol
//! test broker, each on free ports in a temporary folder, stopped and removed when dropped.
//! The machine's shared servers are never touched.

use crate::tls::TestCa;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The broker a [`TlsBroker`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `redis-server` with a TLS port only: `rediss://`.
    Redis,
    /// `mosquitto` with a TLS listener only: `mqtts://`.
    Mosquitto,
    /// `nats-server` with JetStream, requiring TLS: `nats://`.
    Nats,
    /// A RabbitMQ node with a TLS listener only: `amqps://`.
    RabbitMq,
    /// The Kafka-protocol test broker behind a TLS front of the test's own: the broker
    /// reads TLS settings but does not use them. `kafka://`.
    Kafka,
}

/// A broker of a test's own that speaks only TLS, with a server certificate (for
/// `localhost` and `127.0.0.1` unless told otherwise) signed by the test's CA.
pub struct TlsBroker {
    kind: Kind,
    folder: PathBuf,
    port: u16,
    child: Child,
    /// The RabbitMQ node's name, stopped with `rabbitmqctl`.
    node: Option<String>,
    /// The port the broker itself listens on, if a [`TlsFront`] stands before it.
    plaintext_port: Option<u16>,
    front: Option<TlsFront>,
    /// The SCRAM user and password a [`Kind::Kafka`] broker requires a login with.
    scram_user: Option<(String, String)>,
}

/// How long a broker may take to listen: a RabbitMQ node boots in about ten seconds on
/// an idle machine.
const START_TIMEOUT: Duration = Duration::from_secs(120);

impl TlsBroker {
    /// Starts `kind` with a certificate of `ca`. With `client_certificates`, the broker
    /// requires a client certificate signed by `ca` (all but RabbitMQ).
    pub fn start(kind: Kind, ca: &TestCa, client_certificates: bool) -> Result<Self, String> {
        Self::start_named(kind, ca, &["localhost", "127.0.0.1"], client_certificates)
    }

    /// [`TlsBroker::start`] with a certificate for `names` only.
    pub fn start_named(
        kind: Kind,
        ca: &TestCa,
        names: &[&str],
        client_certificates: bool,
    ) -> Result<Self, String> {
        Self::launch(kind, ca, names, client_certificates, None)
    }

    /// A [`Kind::Kafka`] broker that requires a SASL login of every client, as a hosted
    /// Kafka does: SCRAM-SHA-512, with `user` and `password` the one login it knows.
    pub fn start_kafka_with_scram_user(
        ca: &TestCa,
        user: &str,
        password: &str,
    ) -> Result<Self, String> {
        let login = Some((user, password));
        Self::launch(Kind::Kafka, ca, &["localhost", "127.0.0.1"], false, login)
    }

    fn launch(
        kind: Kind,
        ca: &TestCa,
        names: &[&str],
        client_certificates: bool,
        scram_user: Option<(&str, &str)>,
    ) -> Result<Self, String> {
        let folder = std::env::temp_dir().join(format!("justonce-tls-broker-{}", crate::unique()));
        std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        let (cert, key) = ca.server(names);
        let ca_file = ca.ca_file();
        let port = free_port()?;
        let log = std::fs::File::create(folder.join("log"))
            .map_err(|e| format!("{}: {e}", folder.display()))?;
        let mut node = None;
        let (mut plaintext_port, mut front) = (None, None);
        let mut command = match kind {
            Kind::Redis => {
                let mut command = Command::new("redis-server");
                command
                    .args([
                        "--port",
                        "0",
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ])
                    .arg("--dir")
                    .arg(&folder)
                    .args(["--tls-port", &port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(&cert)
                    .arg("--tls-key-file")
                    .arg(&key)
                    .arg("--tls-ca-cert-file")
                    .arg(&ca_file)
                    .args([
                        "--tls-auth-clients",
                        if client_certificates { "yes" } else { "no" },
                    ]);
                command
            }
            Kind::Mosquitto => {
                let config = folder.join("mosquitto.conf");
                let text = format!(
                    "listener {port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n\
                     require_certificate {client_certificates}\nallow_anonymous true\n\
                     persistence false\nlog_dest stderr\n",
                    ca_file.display(),
                    cert.display(),
                    key.display()
                );
                std::fs::write(&config, text).map_err(|e| format!("{}: {e}", config.display()))?;
                let mut command = Command::new("mosquitto");
                command.arg("-c").arg(config);
                command
            }
            Kind::Nats => {
                let mut command = Command::new("nats-server");
                command
                    .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                    .arg(folder.join("jetstream"))
                    .arg("--tls")
                    .arg("--tlscert")
                    .arg(&cert)
                    .arg("--tlskey")
                    .arg(&key);
                if client_certificates {
                    command.arg("--tlsverify").arg("--tlscacert").arg(&ca_file);
                }
                command
            }
            Kind::RabbitMq => {
                let name = format!("justonce_{}@localhost", crate::unique());
                let command = rabbitmq(&folder, &name, port, &ca_file, &cert, &key)?;
                node = Some(name);
                command
            }
            Kind::Kafka => {
                // It listens on its own port and tells clients to come through the front.
                let inner = free_port()?;
                let listener = std::net::TcpListener::bind(("127.0.0.1", port))
                    .map_err(|e| format!("the TLS front's port {port}: {e}"))?;
                let client_ca = client_certificates.then_some(ca_file.as_path());
                front = Some(TlsFront::start(listener, &cert, &key, client_ca, inner)?);
                plaintext_port = Some(inner);
                // Its memory engine forgets users when it stops; SQLite keeps them.
                let storage = match scram_user {
                    Some(_) => "sqlite://nisshi.db",
                    None => "memory://",
                };
                let mut command = crate::own_broker::nisshi_broker(&folder, storage, inner, port)?;
                if let Some((user, password)) = scram_user {
                    make_scram_user(&folder, storage, inner, user, password, &log)?;
                    command.arg("--authentication");
                }
                command
            }
        };
        let stderr = log.try_clone().map_err(|e| e.to_string())?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("{kind:?} cannot start: {command:?}: {e}"))?;
        let mut broker = Self {
            kind,
            folder,
            port,
            child,
            node,
            plaintext_port,
            front,
            scram_user: scram_user.map(|(user, password)| (user.to_owned(), password.to_owned())),
        };
        broker.wait_until_listening()?;
        Ok(broker)
    }

    /// The URL a client connects with, over TLS to `127.0.0.1`.
    pub fn url(&self) -> String {
        let port = self.port;
        match self.kind {
            Kind::Redis => format!("rediss://127.0.0.1:{port}"),
            Kind::Mosquitto => format!("mqtts://127.0.0.1:{port}"),
            Kind::Nats => format!("nats://127.0.0.1:{port}"),
            Kind::RabbitMq => format!("amqps://guest:guest@127.0.0.1:{port}/%2f"),
            Kind::Kafka => format!("kafka://127.0.0.1:{port}"),
        }
    }

    /// Creates `topic` on a [`Kind::Kafka`] broker: over TLS trusting `ca`, with a client
    /// certificate of `ca`, and with its SCRAM login if it requires one.
    pub async fn create_kafka_topic(&self, ca: &TestCa, topic: &str) {
        let (cert, key) = ca.client("admin");
        let mut config = rdkafka::ClientConfig::new();
        config
            .set("bootstrap.servers", format!("127.0.0.1:{}", self.port))
            .set("security.protocol", "ssl")
            .set("ssl.ca.location", ca.ca_file().display().to_string())
            .set("ssl.certificate.location", cert.display().to_string())
            .set("ssl.key.location", key.display().to_string());
        if let Some((user, password)) = &self.scram_user {
            config
                .set("security.protocol", "sasl_ssl")
                .set("sasl.mechanisms", "SCRAM-SHA-512")
                .set("sasl.username", user)
                .set("sasl.password", password);
        }
        crate::create_kafka_topic_with(&config, topic, 1).await
    }

    /// Serves a [`Kind::Kafka`] broker's TLS front with a certificate of `ca` from now on,
    /// as a broker whose certificate was replaced: the connections through the old front
    /// close, and new ones meet the new certificate.
    pub fn replace_kafka_certificate(&mut self, ca: &TestCa) -> Result<(), String> {
        let inner = self
            .plaintext_port
            .ok_or("only the Kafka broker has a TLS front")?;
        drop(self.front.take());
        let (cert, key) = ca.server(&["localhost", "127.0.0.1"]);
        let listener = std::net::TcpListener::bind(("127.0.0.1", self.port))
            .map_err(|e| format!("the TLS front's port {}: {e}", self.port))?;
        self.front = Some(TlsFront::start(listener, &cert, &key, None, inner)?);
        Ok(())
    }

    fn wait_until_listening(&mut self) -> Result<(), String> {
        let port = self.plaintext_port.unwrap_or(self.port);
        wait_for_port(&mut self.child, port)
            .map_err(|e| format!("{:?} {e}:\n{}", self.kind, self.log()))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.folder.join("log")).unwrap_or_default()
    }
}

impl Drop for TlsBroker {
    fn drop(&mut self) {
        if let Some(node) = &self.node {
            let _ = Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
                .args(["-n", node, "stop"])
                .env("HOME", &self.folder)
                .output();
        }
        drop(self.front.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// Waits until something listens on `port`, or `child` exits.
fn wait_for_port(child: &mut Child, port: u16) -> Result<(), String> {
    let started = Instant::now();
    while started.elapsed() < START_TIMEOUT {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited with {status} before it listened"));
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("did not listen on {port} within {START_TIMEOUT:?}"))
}

/// Makes the SCRAM-SHA-512 login `user` in the Kafka test broker's `storage`. A broker that
/// requires SASL takes no request before a login, making a user included, so a broker
/// without SASL on the same storage makes it, and stops.
fn make_scram_user(
    folder: &Path,
    storage: &str,
    port: u16,
    user: &str,
    password: &str,
    log: &std::fs::File,
) -> Result<(), String> {
    let output = |log: &std::fs::File| log.try_clone().map_err(|e| e.to_string());
    let mut broker = crate::own_broker::nisshi_broker(folder, storage, port, port)?
        .stdin(Stdio::null())
        .stdout(output(log)?)
        .stderr(output(log)?)
        .spawn()
        .map_err(|e| format!("the Kafka test broker cannot start: {e}"))?;
    let made = wait_for_port(&mut broker, port).and_then(|()| {
        let broker_url = format!("tcp://127.0.0.1:{port}");
        let made = Command::new(crate::own_broker::nisshi()?)
            .current_dir(folder)
            .args(["user", "create", "--broker", &broker_url])
            .args(["--mechanism", "scram512", user, password])
            .output()
            .map_err(|e| e.to_string())?;
        if made.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&made.stderr).into_owned())
        }
    });
    let _ = broker.kill();
    let _ = broker.wait();
    made.map_err(|e| format!("making the SCRAM user {user}: {e}"))
}

/// A TLS listener that forwards each connection's bytes, once its handshake is done, to a
/// plaintext port: TLS for a server that does not speak it. Stops when dropped.
struct TlsFront {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TlsFront {
    /// Accepts TLS on `listener` with the certificate `cert` and its key `key`, requiring a
    /// client certificate signed by `client_ca` if given, and forwards to `backend`.
    fn start(
        listener: std::net::TcpListener,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
        backend: u16,
    ) -> Result<Self, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certificates = |file: &Path| {
            CertificateDer::pem_file_iter(file)
                .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("{}: {e}", file.display()))
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                roots.add_parsable_certificates(certificates(ca)?);
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| e.to_string())?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let key =
            PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
        let config = builder
            .with_single_cert(certificates(cert)?, key)
            .map_err(|e| e.to_string())?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|e| e.to_string())?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let accepting = async {
                    while let Ok((client, _)) = listener.accept().await {
                        let acceptor = acceptor.clone();
                        tokio::spawn(async move {
                            // A refused handshake is the client's to report.
                            let Ok(mut client) = acceptor.accept(client).await else {
                                return;
                            };
                            let address = ("127.0.0.1", backend);
                            if let Ok(mut server) = tokio::net::TcpStream::connect(address).await {
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            }
                        });
                    }
                };
                tokio::select! {
                    () = accepting => {}
                    _ = stopped => {}
                }
            });
        });
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A RabbitMQ node of its own: its own name, ports, database, logs and configuration
/// (TLS only, no plugins), and an Erlang cookie in its folder, run in the foreground as the
/// test's user.
fn rabbitmq(
    folder: &Path,
    node: &str,
    port: u16,
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> Result<Command, String> {
    let config = folder.join("rabbitmq.conf");
    let text = format!(
        "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
         ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
         ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
        ca.display(),
        cert.display(),
        key.display()
    );
    std::fs::write(&config, text).map_err(|e| format!("{}: {e}", config.display()))?;
    let plugins = folder.join("enabled_plugins");
    std::fs::write(&plugins, "").map_err(|e| format!("{}: {e}", plugins.display()))?;
    let mut command = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
    command
        .env("HOME", folder)
        .env("RABBITMQ_NODENAME", node)
        .env("RABBITMQ_NODE_PORT", free_port()?.to_string())
        .env("RABBITMQ_DIST_PORT", free_port()?.to_string())
        .env("RABBITMQ_MNESIA_BASE", folder.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", folder.join("logs"))
        .env("RABBITMQ_CONFIG_FILE", &config)
        .env("RABBITMQ_ENABLED_PLUGINS_FILE", &plugins)
        .env("RABBITMQ_PID_FILE", folder.join("pid"));
    Ok(command)
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| format!("no free port: {e}"))
}
