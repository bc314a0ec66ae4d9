//! The docs as readers meet them: the README stays a front door, a table cell holds a value,
//! every code block names its language (so that no prose block is compiled as Rust, and no
//! Rust block is left out), every page's Rust blocks are doc tests of the facade, links
//! between pages land, and the `justonce check` examples run as written.

use std::collections::{HashMap, HashSet};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const README_LINES: usize = 300;
const CELL_CHARS: usize = 300;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Markdown pages: the root's and those under `docs/`.
fn pages() -> Vec<PathBuf> {
    let mut pages = Vec::new();
    for folder in [root(), root().join("docs")] {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|ext| ext == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    assert!(pages.len() > 5, "the pages are missing: {pages:?}");
    pages
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn name(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Each line with its number, and whether it lies inside a fenced code block (the fences
/// themselves count as inside).
fn lines_with_fences(text: &str) -> Vec<(usize, &str, bool)> {
    let mut inside = false;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        lines.push((index + 1, line, inside || fence));
        if fence {
            inside = !inside;
        }
    }
    lines
}

/// The cells of a table row: split at each `|` that is not escaped.
fn cells(row: &str) -> Vec<String> {
    let mut cells = vec![String::new()];
    let mut escaped = false;
    for c in row.trim().chars() {
        match c {
            '|' if !escaped => cells.push(String::new()),
            _ => cells.last_mut().unwrap().push(c),
        }
        escaped = c == '\\';
    }
    // The row's leading and trailing pipes leave an empty cell at each end.
    cells.remove(0);
    cells.pop();
    cells
}

#[test]
fn the_readme_is_a_front_door_of_at_most_300_lines() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_LINES,
        "README.md has {lines} lines, over {README_LINES}: move reference to a page under docs/"
    );
}

#[test]
fn no_table_cell_holds_more_than_300_characters() {
    let mut long = Vec::new();
    for page in pages() {
        let text = read(&page);
        for (number, line, in_code) in lines_with_fences(&text) {
            if in_code || !line.trim_start().starts_with('|') {
                continue;
            }
            for cell in cells(line) {
                let chars = cell.trim().chars().count();
                if chars > CELL_CHARS {
                    long.push(format!(
                        "{}:{number}: a cell of {chars} characters",
                        name(&page)
                    ));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "a table cell holds a value, not a paragraph: write these as sentences under the table\n{}",
        long.join("\n")
    );
}

#[test]
fn every_code_block_names_its_language_and_none_is_ignored() {
    let mut bad = Vec::new();
    for page in pages() {
        let text = read(&page);
        let mut opening = true;
        for (number, line, _) in lines_with_fences(&text) {
            let Some(info) = line.trim_start().strip_prefix("```") else {
                continue;
            };
            if opening && info.trim().is_empty() {
                bad.push(format!(
                    "{}:{number}: a block without a language",
                    name(&page)
                ));
            }
            if opening && info.contains("ignore") {
                bad.push(format!(
                    "{}:{number}: `{info}`: compile it, `no_run` if it needs a server",
                    name(&page)
                ));
            }
            opening = !opening;
        }
        assert!(opening, "{}: a code block is never closed", name(&page));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The facade compiles the README and every page under `docs/` as doc tests: a new page
/// must be added there, or its Rust blocks would never be built.
#[test]
fn every_page_is_compiled_as_doc_tests_of_the_facade() {
    let facade = read(&root().join("crates/justonce/src/lib.rs"));
    let missing: Vec<String> = pages()
        .into_iter()
        .map(|page| name(&page))
        .filter(|page| page == "README.md" || page.starts_with("docs/"))
        .filter(|page| !facade.contains(&format!("include_str!(\"../../../{page}\")")))
        .collect();
    assert!(
        missing.is_empty(),
        "crates/justonce/src/lib.rs does not include {missing:?} in its doc tests"
    );
}

/// A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as `-`,
/// and `-1`, `-2` … after a repeated one.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = HashSet::new();
    for (_, line, in_code) in lines_with_fences(text) {
        if in_code || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let count = seen.entry(slug.clone()).or_insert(0);
        anchors.insert(match *count {
            0 => slug.clone(),
            n => format!("{slug}-{n}"),
        });
        *count += 1;
    }
    anchors
}

#[test]
fn links_between_pages_land_on_a_page_and_a_heading() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = read(&page);
        for (number, line, in_code) in lines_with_fences(&text) {
            if in_code {
                continue;
            }
            for (start, _) in line.match_indices("](") {
                let rest = &line[start + 2..];
                let Some(end) = rest.find(')') else { continue };
                let target = &rest[..end];
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let linked = if file.is_empty() {
                    page.clone()
                } else {
                    page.parent().unwrap().join(file)
                };
                let place = format!("{}:{number}: {target}", name(&page));
                if !linked.exists() {
                    broken.push(format!("{place}: no such file"));
                } else if !anchor.is_empty() && !anchors(&read(&linked)).contains(anchor) {
                    broken.push(format!("{place}: no such heading"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The shell block of `page` that holds `marker`, exactly as written.
fn block(page: &str, marker: &str) -> String {
    let text = read(&root().join(page));
    let blocks: Vec<&str> = text
        .split("```sh\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap())
        .filter(|block| block.contains(marker))
        .collect();
    assert_eq!(blocks.len(), 1, "{page}: one block holding {marker:?}");
    blocks[0].to_owned()
}

/// A folder whose `bin` holds `justonce`, the examples, and a `cargo` that runs an example
/// as `cargo run [-q] --example NAME -- ARGS` would, once it is built, and takes
/// `cargo build` as done: the docs' commands run beside the test binary, which cannot build.
struct Checkout {
    dir: PathBuf,
    bin: PathBuf,
}

impl Checkout {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("justonce-docs-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let justonce = super::check::justonce();
        let binaries = [
            ("justonce", justonce.as_path()),
            ("invoices", Path::new(env!("CARGO_BIN_EXE_invoices"))),
            ("payments", Path::new(env!("CARGO_BIN_EXE_payments"))),
        ];
        for (name, path) in binaries {
            std::os::unix::fs::symlink(path, bin.join(name)).unwrap();
        }
        let cargo = bin.join("cargo");
        std::fs::write(
            &cargo,
            "#!/bin/sh\n\
             while [ \"$#\" -gt 0 ] && [ \"$1\" != --example ]; do shift; done\n\
             name=$2; shift 2\n\
             while [ \"$#\" -gt 0 ] && [ \"$1\" != -- ]; do shift; done\n\
             [ \"$#\" -gt 0 ] && shift\n\
             exec \"$(dirname \"$0\")/$name\" \"$@\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        Self { dir, bin }
    }

    /// `sh -c SCRIPT` in the folder, with its `bin` first on the PATH.
    fn shell(&self, script: &str) -> Command {
        self.shell_of("sh", script)
    }

    /// `SHELL -c SCRIPT` in the folder, with its `bin` first on the PATH.
    fn shell_of(&self, shell: &str, script: &str) -> Command {
        let path = format!("{}:{}", self.bin.display(), std::env::var("PATH").unwrap());
        let mut command = Command::new(shell);
        command
            .arg("-c")
            .arg(script)
            .current_dir(&self.dir)
            .env("PATH", path);
        command
    }

    fn run(&self, script: &str) -> Output {
        let output = self.shell(script).output().unwrap();
        eprintln!(
            "{script}\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A process group started for a test, ended with it.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let _ = self.0.wait();
    }
}

fn assert_passed(output: &Output, events: usize) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let effects = format!("effects: {events} events with one, 0 with none, 0 with more than one");
    assert!(stdout.contains(&effects), "{stdout}");
    assert!(
        stdout.contains("passed: every event took effect once and every try was taken"),
        "{stdout}"
    );
}

#[test]
fn the_check_of_an_endpoint_in_the_docs_runs_as_written() {
    let checkout = Checkout::new("endpoint");
    let start = block("docs/check.md", "cargo run --example payments");
    let check = block("docs/check.md", "justonce check http://");
    let address = "127.0.0.1:8081";
    assert!(start.contains(address) && check.contains(address));
    assert!(
        TcpStream::connect(address).is_err(),
        "{address} is taken: the example in docs/check.md listens there"
    );

    let payments = Group(
        checkout
            .shell(&start)
            .process_group(0)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    while TcpStream::connect(address).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "payments did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_passed(&checkout.run(&check), 30);
    drop(payments);
}

#[test]
fn the_check_of_a_job_in_the_docs_runs_as_written() {
    let checkout = Checkout::new("job");
    let job = block("docs/check.md", "justonce check --run");
    assert_passed(&checkout.run(&job), 3);
}

/// The README's tour, pasted into one shell at the root of a checkout: a job run twice, a
/// webhook posted twice, and the service killed after the commit and before the answer.
#[test]
fn the_readme_tour_runs_as_written() {
    let checkout = Checkout::new("tour");
    // The root of a checkout: its examples, and the binary where Cargo builds it.
    std::os::unix::fs::symlink(root().join("examples"), checkout.dir.join("examples")).unwrap();
    let debug = checkout.dir.join("target/debug");
    std::fs::create_dir_all(&debug).unwrap();
    std::os::unix::fs::symlink(super::check::justonce(), debug.join("justonce")).unwrap();
    let readme = read(&root().join("README.md"));
    let tour = readme
        .split("## A two-minute tour")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("the README's tour");
    let script: String = tour
        .split("```sh\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap())
        .collect();
    for port in [8080, 9090, 9000] {
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_err(),
            "port {port} is taken: the tour's service and receiver listen there"
        );
    }

    let log = checkout.dir.join("tour.log");
    let mut shell = checkout.shell_of("bash", &script);
    shell
        .process_group(0)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::inherit());
    let mut tour = Group(shell.spawn().unwrap());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = tour.0.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(90), "the tour hung");
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(tour);
    let out = std::fs::read_to_string(&log).unwrap();
    eprintln!("{out}");
    assert!(status.success(), "{status}");

    assert!(out.contains("created 5 invoices, skipped 0 already invoiced"));
    assert!(out.contains("created 0 invoices, skipped 5 already invoiced"));
    for answer in [
        r#"{"key":"demo:evt_1","status":"accepted"} 200"#,
        r#"{"key":"demo:evt_1","status":"duplicate"} 200"#,
        r#"{"key":"demo:evt_2","status":"duplicate"} 200"#,
    ] {
        assert_eq!(out.matches(answer).count(), 1, "{answer}");
    }
    assert!(out.lines().any(|line| line == " 000"), "the killed answer");
    for event in ["evt_1", "evt_2"] {
        let delivery = format!("Idempotency-Key: demo:{event} ");
        assert_eq!(out.matches(&delivery).count(), 1, "{event} delivered once");
    }
    let sent_due_dead: Vec<&str> = out
        .lines()
        .skip_while(|line| !line.contains("sent  due  dead"))
        .nth(1)
        .expect("the stats' deliveries")
        .split_whitespace()
        .take(3)
        .collect();
    assert_eq!(sent_due_dead, ["2", "0", "0"]);
}
