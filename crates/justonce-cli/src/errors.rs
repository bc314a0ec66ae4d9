//! What the commands say when a store fails: where one that cannot be opened is, and a
//! database's failure in its own words.

use justonce_cli_support::Usage;
use justonce_cli_support::database::DatabaseKind;
use justonce_sql::sqlx::mysql::MySqlConnectOptions;
use justonce_sql::sqlx::postgres::PgConnectOptions;
use justonce_sql::sqlx::sqlite::SqliteConnectOptions;
use std::path::PathBuf;
use std::str::FromStr;

/// A database that cannot be opened: its settings, such as a CA that did not sign the
/// server's certificate, are bad configuration (exit code 2); anything else is a failure,
/// said once with where the database is: `opening the database at 127.0.0.1:5432:
/// Connection refused (os error 111)`.
pub fn opening_failed(error: justonce_sql::Error, database: &str, url: &str) -> anyhow::Error {
    if let justonce_sql::Error::Config(problem) = error {
        return Usage(problem).into();
    }
    let mut cause = store_cause(&error);
    let place = match DatabaseKind::of(url) {
        Ok(DatabaseKind::Sqlite) => match sqlite_file(url) {
            Some(file) => {
                let folder = file.parent().filter(|f| !f.as_os_str().is_empty());
                if let Some(folder) = folder.filter(|folder| !folder.is_dir()) {
                    cause = format!("its folder {} does not exist", folder.display());
                }
                format!("{database} file {}", file.display())
            }
            None => format!("{database} in memory"),
        },
        Ok(DatabaseKind::Postgres) => match PgConnectOptions::from_str(url) {
            Ok(o) => server_address(database, o.get_host(), o.get_port(), o.get_socket()),
            Err(_) => database.to_owned(),
        },
        Ok(DatabaseKind::MySql) => match MySqlConnectOptions::from_str(url) {
            Ok(o) => server_address(database, o.get_host(), o.get_port(), o.get_socket()),
            Err(_) => database.to_owned(),
        },
        Err(_) => database.to_owned(),
    };
    anyhow::anyhow!("opening {place}: {cause}")
}

/// `the database at HOST:PORT`, or at its socket, as the driver reads the URL and its
/// environment variables.
fn server_address(database: &str, host: &str, port: u16, socket: Option<&PathBuf>) -> String {
    match socket {
        Some(socket) => format!("{database} at {}", socket.display()),
        None => format!("{database} at {host}:{port}"),
    }
}

/// The file a `sqlite:` URL names; none for another database or one in memory.
pub fn sqlite_file(url: &str) -> Option<PathBuf> {
    if DatabaseKind::of(url) != Ok(DatabaseKind::Sqlite)
        || url.contains(":memory:")
        || url.contains("mode=memory")
    {
        return None;
    }
    let options = SqliteConnectOptions::from_str(url).ok()?;
    Some(options.get_filename().to_owned())
}

/// A store error as the last words of a message: a database's failure in its own words,
/// without the driver's wrapping, the chain of sources it repeats, or where in the server's
/// source code it was raised (PostgreSQL's `at line 948`).
pub fn store_error(error: &justonce_sql::Error) -> String {
    match error {
        justonce_sql::Error::Database { .. } => format!("database error: {}", store_cause(error)),
        other => other.to_string(),
    }
}

/// The cause of a store error, without the words `database error`.
fn store_cause(error: &justonce_sql::Error) -> String {
    let justonce_sql::Error::Database { source, .. } = error else {
        return error.to_string();
    };
    match source.downcast_ref::<justonce_sql::sqlx::Error>() {
        Some(justonce_sql::sqlx::Error::Database(database)) => database.message().to_owned(),
        Some(justonce_sql::sqlx::Error::Io(io)) => io.to_string(),
        _ => source.to_string(),
    }
}
