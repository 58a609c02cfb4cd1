//! A kube-fence token fencing a write outside Kubernetes: PostgreSQL is the arbiter.
//!
//! ```sh
//! export PG_CONNINFO="host=/run/postgresql user=app dbname=app"   # tokio-postgres key=value form
//! cargo run --example pg_arbiter -- init
//! cargo run --example pg_arbiter -- write NAMESPACE LEASE HOLDER RESOURCE [--pause-before-write] [--unfenced]
//! ```
//!
//! `write` acquires the kube-fence lease `LEASE` (the token is the proof), prepares an effect on
//! `RESOURCE`, and commits it in one transaction with the fence:
//!
//! ```sql
//! UPDATE fence SET last_fence = $token WHERE resource = $resource AND last_fence < $token;
//! -- 0 rows: a newer token already wrote this resource — roll back, nothing of ours sticks
//! INSERT INTO effects (resource, token, holder, value) VALUES (...);  -- the effect itself
//! COMMIT;
//! ```
//!
//! The comparison happens at the arbiter, in the same transaction as the effect: the row lock
//! the `UPDATE` takes orders every writer of the resource, and `last_fence` commits with the
//! effect or not at all. No clock, no lease check, no API server is consulted at write time; a
//! holder paused past its lease (`--pause-before-write`: the process stops itself with SIGSTOP
//! between preparing and committing) whose successor wrote first gets 0 rows and stops.
//! `--unfenced` drops the `last_fence < $token` condition: the control that shows the stale
//! effect landing.
//!
//! One JSON line per step on stdout (`granted`, `prepared`, `written`, `refused`).

use std::time::Duration;

use kube_fence::client::{AcquireOptions, Leases};
use kube_fence_api::token::Token;
use serde_json::json;
use tokio_postgres::{Client, NoTls};

/// The arbiter's tables: the fence (the newest token per resource) and the effects (here a
/// ledger, which also lets a test read back the history of what was committed, in commit order
/// per resource: `seq` is taken after the fence row's lock).
pub(crate) const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS fence (resource text PRIMARY KEY, last_fence bigint NOT NULL);
    CREATE TABLE IF NOT EXISTS effects (
        seq bigserial PRIMARY KEY, resource text NOT NULL, token bigint NOT NULL, holder text NOT NULL, value text NOT NULL);";

/// What the arbiter decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Written {
        seq: i64,
    },
    /// A token at least as new already wrote the resource.
    Refused {
        last_fence: i64,
    },
}

/// Commits `value` as `holder`'s effect on `resource` if, and only if, `token` is newer than
/// every token that wrote it before — decided by the database in the transaction of the effect.
pub(crate) async fn fenced_write(
    db: &mut Client,
    resource: &str,
    token: Token,
    holder: &str,
    value: &str,
    fenced: bool,
) -> Result<Outcome, tokio_postgres::Error> {
    let token = i64::try_from(token.get()).unwrap_or(i64::MAX); // tokens are <= 2^63-1: always fits
    let tx = db.transaction().await?;
    tx.execute("INSERT INTO fence (resource, last_fence) VALUES ($1, -1) ON CONFLICT (resource) DO NOTHING", &[&resource]).await?;
    let updated = if fenced {
        tx.execute("UPDATE fence SET last_fence = $2 WHERE resource = $1 AND last_fence < $2", &[&resource, &token]).await?
    } else {
        tx.execute("UPDATE fence SET last_fence = $2 WHERE resource = $1", &[&resource, &token]).await?
    };
    if updated == 0 {
        let row = tx.query_one("SELECT last_fence FROM fence WHERE resource = $1", &[&resource]).await?;
        tx.rollback().await?;
        return Ok(Outcome::Refused { last_fence: row.get(0) });
    }
    let row = tx
        .query_one(
            "INSERT INTO effects (resource, token, holder, value) VALUES ($1, $2, $3, $4) RETURNING seq",
            &[&resource, &token, &holder, &value],
        )
        .await?;
    tx.commit().await?;
    Ok(Outcome::Written { seq: row.get(0) })
}

async fn connect() -> Result<Client, Box<dyn std::error::Error>> {
    let conninfo = std::env::var("PG_CONNINFO").map_err(|_| "set PG_CONNINFO, e.g. \"host=/run/postgresql user=app dbname=app\"")?;
    let (client, connection) = tokio_postgres::connect(&conninfo, NoTls).await?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            eprintln!("pg_arbiter: the database connection failed: {err}");
        }
    });
    Ok(client)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let positional: Vec<&str> = args.iter().filter(|a| !a.starts_with("--")).map(String::as_str).collect();
    match positional.as_slice() {
        ["init"] => {
            connect().await?.batch_execute(SCHEMA).await?;
            Ok(())
        }
        ["write", namespace, lease, holder, resource] => {
            let kube = kube::Client::try_default().await?;
            let leases = Leases::new(kube, namespace);
            let options = AcquireOptions::default().duration(Duration::from_secs(1)).timeout(Duration::from_secs(60));
            let grant = leases.acquire(lease, holder, options).await?;
            println!("{}", json!({"event": "granted", "holder": holder, "token": grant.token.get(), "pid": std::process::id()}));
            // Heartbeats while it works; they stop with the process when it is paused, and the
            // lease expires — but the arbiter, not this keep-alive, decides whether the effect sticks.
            let keep_alive = leases.keep_alive(&grant);
            let mut db = connect().await?;
            let value = format!("{holder} with token {}", grant.token);
            println!("{}", json!({"event": "prepared", "token": grant.token.get()}));
            if flag("--pause-before-write") {
                // Stopped here by itself, deterministically: prepared, not yet committed.
                rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)?;
            }
            match fenced_write(&mut db, resource, grant.token, holder, &value, !flag("--unfenced")).await? {
                Outcome::Written { seq } => println!("{}", json!({"event": "written", "token": grant.token.get(), "seq": seq})),
                Outcome::Refused { last_fence } => {
                    println!("{}", json!({"event": "refused", "token": grant.token.get(), "last_fence": last_fence}))
                }
            }
            keep_alive.stop().await;
            // Releasing a grant that was lost meanwhile is not an error.
            leases.release(&grant).await?;
            Ok(())
        }
        _ => {
            eprintln!("usage: pg_arbiter init | pg_arbiter write NAMESPACE LEASE HOLDER RESOURCE [--pause-before-write] [--unfenced]");
            std::process::exit(2);
        }
    }
}
