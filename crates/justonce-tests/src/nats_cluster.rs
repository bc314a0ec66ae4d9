//! Three NATS servers of a test's own, clustered, with JetStream: each on its own client,
//! route and monitoring ports, with its own store folder in one temporary folder. A test
//! kills one with SIGKILL (the stream leader's, found through the JetStream API) and
//! starts it again. The machine's shared NATS server is never touched.

use crate::own_broker::free_ports;
use async_nats::jetstream;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How long the cluster may take to elect its JetStream meta leader.
const STARTUP: Duration = Duration::from_secs(60);

/// The cluster's name, in every server's configuration.
const CLUSTER: &str = "justonce";

/// A NATS cluster of a test's own; killed, and its folder removed, when dropped.
pub struct NatsCluster {
    folder: PathBuf,
    nodes: Vec<Node>,
}

/// One server of the cluster: `n<index>`.
struct Node {
    port: u16,
    route_port: u16,
    monitor_port: u16,
    running: Option<Child>,
}

impl NatsCluster {
    /// Starts `size` servers, routed to each other, and returns once JetStream has a meta
    /// leader that every other server follows.
    pub async fn start(size: usize) -> Result<Self, String> {
        let folder =
            std::env::temp_dir().join(format!("justonce-nats-cluster-{}", crate::unique()));
        std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        let nodes = free_ports(3 * size)?
            .chunks(3)
            .map(|ports| Node {
                port: ports[0],
                route_port: ports[1],
                monitor_port: ports[2],
                running: None,
            })
            .collect();
        let mut cluster = Self { folder, nodes };
        for node in 0..size {
            cluster.restart(node).await?;
        }
        cluster.wait_for_meta_leader().await?;
        Ok(cluster)
    }

    /// Every server's URL, separated by commas, as a client of the cluster is given them.
    pub fn url(&self) -> String {
        let urls: Vec<String> = (0..self.nodes.len()).map(|n| self.node_url(n)).collect();
        urls.join(",")
    }

    /// The URL of server `node` alone.
    pub fn node_url(&self, node: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[node].port)
    }

    /// The server name of `node`, as JetStream reports leaders.
    pub fn name(node: usize) -> String {
        format!("n{node}")
    }

    /// The node that leads `stream`'s replicas, as the JetStream API answers
    /// (`$JS.API.STREAM.INFO.<stream>`, its `cluster.leader`).
    pub async fn stream_leader(
        &self,
        jetstream: &jetstream::Context,
        stream: &str,
    ) -> Result<usize, String> {
        let mut stream = jetstream
            .get_stream(stream)
            .await
            .map_err(|e| format!("stream {stream}: {e}"))?;
        let info = stream.info().await.map_err(|e| e.to_string())?;
        let leader = info
            .cluster
            .as_ref()
            .and_then(|cluster| cluster.leader.clone())
            .ok_or("the stream has no leader")?;
        (0..self.nodes.len())
            .find(|&node| Self::name(node) == leader)
            .ok_or_else(|| format!("the leader {leader} is not a server of this cluster"))
    }

    /// SIGKILLs server `node` and waits until it is gone.
    pub async fn kill(&mut self, node: usize) -> Result<(), String> {
        if let Some(mut child) = self.nodes[node].running.take() {
            child
                .kill()
                .await
                .map_err(|e| format!("cannot kill {}: {e}", Self::name(node)))?;
        }
        Ok(())
    }

    /// Starts server `node`, with the store it had, and returns once it takes clients.
    pub async fn restart(&mut self, node: usize) -> Result<(), String> {
        let mut child = self
            .command(node)
            .spawn()
            .map_err(|e| format!("cannot start nats-server: {e}"))?;
        let given_up = Instant::now() + STARTUP;
        while tokio::net::TcpStream::connect(("127.0.0.1", self.nodes[node].port))
            .await
            .is_err()
        {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!(
                    "{} exited: {status}; see {}",
                    Self::name(node),
                    self.log(node).display()
                ));
            }
            if Instant::now() >= given_up {
                return Err(format!("{} did not listen in time", Self::name(node)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.nodes[node].running = Some(child);
        Ok(())
    }

    /// The command that runs server `node` in the foreground, routed to the others.
    fn command(&self, node: usize) -> Command {
        let this = &self.nodes[node];
        let store = self.folder.join(Self::name(node));
        let routes: Vec<String> = (self.nodes.iter().enumerate())
            .filter(|&(other, _)| other != node)
            .map(|(_, other)| format!("nats://127.0.0.1:{}", other.route_port))
            .collect();
        let mut command = Command::new("nats-server");
        command
            .args(["-a", "127.0.0.1", "-p", &this.port.to_string()])
            .args(["-m", &this.monitor_port.to_string()])
            .args(["--server_name", &Self::name(node), "-js", "-sd"])
            .arg(&store)
            .args(["--cluster_name", CLUSTER, "--cluster"])
            .arg(format!("nats://127.0.0.1:{}", this.route_port))
            .args(["--routes", &routes.join(",")])
            .arg("-l")
            .arg(self.log(node))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        command
    }

    /// Where server `node` logs.
    fn log(&self, node: usize) -> PathBuf {
        self.folder.join(format!("{}.log", Self::name(node)))
    }

    /// Waits until every running server names the same JetStream meta leader and the
    /// leader sees each of the others current: only then can a stream of as many replicas
    /// as servers be created.
    async fn wait_for_meta_leader(&self) -> Result<(), String> {
        let given_up = Instant::now() + STARTUP;
        // reqwest's TLS, unused here, needs a provider to build a client.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::new();
        loop {
            let mut leaders = Vec::new();
            let mut current = 0;
            for node in &self.nodes {
                let url = format!("http://127.0.0.1:{}/jsz", node.monitor_port);
                let meta = match client.get(&url).send().await {
                    Ok(answer) => answer.bytes().await.ok().and_then(|body| {
                        let jsz: serde_json::Value = serde_json::from_slice(&body).ok()?;
                        Some(jsz["meta_cluster"].clone())
                    }),
                    Err(_) => None,
                };
                let Some(meta) = meta else { continue };
                leaders.push(meta["leader"].as_str().unwrap_or_default().to_owned());
                let replicas = meta["replicas"].as_array().map(Vec::as_slice);
                current = current.max(
                    replicas
                        .unwrap_or_default()
                        .iter()
                        .filter(|replica| replica["current"] == true)
                        .count(),
                );
            }
            let agreed = leaders.len() == self.nodes.len()
                && !leaders[0].is_empty()
                && leaders.iter().all(|leader| *leader == leaders[0]);
            if agreed && current + 1 == self.nodes.len() {
                return Ok(());
            }
            if Instant::now() >= given_up {
                return Err(format!(
                    "JetStream elected no meta leader followed by every server in time \
                     (leaders {leaders:?}); see the logs in {}",
                    self.folder.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(child) = &mut node.running {
                let _ = child.start_kill();
            }
        }
        // A failing test keeps the servers' logs it points to.
        if std::thread::panicking() {
            eprintln!(
                "the NATS cluster's logs are kept in {}",
                self.folder.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.folder);
        }
    }
}
