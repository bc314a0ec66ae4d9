//! `justonce`: the service that receives webhooks, stores each event once, answers 2xx and
//! delivers it with its own key; and the commands that look after its database.
//!
//! Exit codes: 0 on success, 2 on bad usage or configuration, 1 on failure.

mod admin_api;
mod check;
mod cli;
mod commands;
mod config;
mod console;
mod errors;
mod listener;
mod logs;
mod probes;
mod purge;
mod serve;
#[cfg(feature = "otlp")]
mod traces;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use cli::{Cli, Command, Configured};
use justonce_cli_support::Usage;
use std::process::ExitCode;

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    // A file named on the command line must exist. JUSTONCE_CONFIG may name an absent one,
    // as the default may be: the container image sets it and runs on variables alone.
    let named_by =
        (matches.value_source("config") == Some(ValueSource::CommandLine)).then_some("--config");
    let command = match cli.command {
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "justonce",
                &mut std::io::stdout(),
            );
            return ExitCode::SUCCESS;
        }
        Command::Configured(command) => *command,
    };
    // The bench fills tables with statements meant to be slow: sqlx's warning about each
    // would bury its progress.
    let default_filter = match command {
        Configured::Bench(_) => "info,sqlx::query=error",
        _ => "info",
    };
    // The file may choose the log format: logging starts once it is read.
    let settings = config::load(&cli.config, named_by, &config::process_env());
    let format = match (&settings, cli.log_format) {
        (_, Some(format)) => format,
        (Ok(settings), None) => settings.log_format,
        (Err(_), None) => logs::LogFormat::default(),
    };
    // Only the service's spans are worth a trace.
    let traces_url = match (&command, &settings) {
        (Configured::Serve { .. }, Ok(settings)) => settings.traces_url.as_deref(),
        _ => None,
    };
    // Dropped after the runtime: the spans of everything below are flushed.
    let _traces = match logs::init(format, default_filter, traces_url) {
        Ok(traces) => traces,
        Err(error) => {
            report(format, &error);
            return ExitCode::FAILURE;
        }
    };
    let settings = match settings {
        Ok(settings) => settings,
        Err(error) => {
            report(format, &error);
            return ExitCode::from(2);
        }
    };
    for variable in &settings.unknown_variables {
        if cli.strict {
            let refused =
                anyhow::anyhow!("{variable}: no setting has this name (refused by --strict)");
            report(format, &refused);
        } else {
            tracing::warn!("{variable}: no setting has this name; it is ignored");
        }
    }
    if cli.strict && !settings.unknown_variables.is_empty() {
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            report(format, &anyhow::anyhow!("cannot start: {error}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(settings, command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<Usage>() => {
            report(format, &error);
            ExitCode::from(2)
        }
        Err(error) => {
            report(format, &error);
            ExitCode::FAILURE
        }
    }
}

/// Says why the command ends: a plain line, or a JSON error line among the others.
fn report(format: logs::LogFormat, error: &anyhow::Error) {
    let reason = reason(error);
    match format {
        logs::LogFormat::Text => eprintln!("justonce: {reason}"),
        logs::LogFormat::Json => tracing::error!("{reason}"),
    }
}

/// The error and its causes, each said once: a cause that its error's text already holds
/// is left out, and a store error ends the line with the database's own words.
fn reason(error: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        if let Some(store) = cause.downcast_ref::<justonce_sql::Error>() {
            parts.push(errors::store_error(store));
            break;
        }
        let text = cause.to_string();
        if !parts.last().is_some_and(|last| last.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}
