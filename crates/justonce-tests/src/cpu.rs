//! How busy the machine's cores and this process were while a benchmark ran, from the
//! kernel's counts in `/proc`: on a machine the broker, the database and the consumer
//! share, a figure with every core busy is bound by CPU, not by waiting.

use std::time::Instant;

/// A running clock with the CPU counts at its start.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    started: Instant,
    cpu: CpuCounts,
}

/// The clock ticks used so far: by all cores, busy and in all, and by this process.
#[derive(Debug, Clone, Copy)]
struct CpuCounts {
    machine_busy: u64,
    machine_all: u64,
    process: u64,
}

/// A count of messages over a clock's time, with the cores busy meanwhile.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timed {
    /// The messages over the seconds.
    pub per_second: f64,
    /// The cores the whole machine kept busy on average, out of [`cores`].
    pub machine_cores: f64,
    /// The cores this process kept busy on average.
    pub process_cores: f64,
}

impl Clock {
    /// A clock started now.
    pub fn start() -> Self {
        Self {
            cpu: CpuCounts::now(),
            started: Instant::now(),
        }
    }

    /// `messages` over the time since the start, with the cores used meanwhile.
    pub fn stop(&self, messages: usize) -> Timed {
        let seconds = self.started.elapsed().as_secs_f64();
        let now = CpuCounts::now();
        let all = now.machine_all.saturating_sub(self.cpu.machine_all).max(1) as f64;
        let cores = cores() as f64;
        let busy = now.machine_busy.saturating_sub(self.cpu.machine_busy) as f64;
        let process = now.process.saturating_sub(self.cpu.process) as f64;
        Timed {
            per_second: messages as f64 / seconds,
            machine_cores: busy / all * cores,
            // The machine's ticks in all are every core's: one core's are `all / cores`.
            process_cores: process / (all / cores),
        }
    }
}

/// The cores `/proc/stat` counts.
pub fn cores() -> usize {
    let stat = std::fs::read_to_string("/proc/stat").expect("a Linux /proc");
    let numbered = |line: &&str| line.starts_with("cpu") && !line.starts_with("cpu ");
    stat.lines().filter(numbered).count().max(1)
}

impl CpuCounts {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").expect("a Linux /proc");
        let ticks: Vec<u64> = (stat.lines().next())
            .and_then(|line| line.strip_prefix("cpu "))
            .expect("the cores' line in /proc/stat")
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
        let machine_all = ticks.iter().take(8).sum::<u64>();
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        Self {
            machine_busy: machine_all - idle,
            machine_all,
            process: process_ticks(),
        }
    }
}

/// This process's user and system ticks, from `/proc/self/stat`.
fn process_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("a Linux /proc");
    // The fields after the command's closing parenthesis; utime and stime are the 12th
    // and 13th of them.
    let after_name = &stat[stat.rfind(')').map_or(0, |at| at + 2)..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}
