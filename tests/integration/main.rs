//! The one integration-test binary: each file is a module.

mod access;
mod campaigns;
mod cli;
mod database;
mod disk_full;
mod errors;
mod fleet;
mod idempotency;
mod keys_after_crash;
mod kill;
mod leases;
mod lost_commit;
mod orphans;
mod owners;
mod ports;
mod processes;
mod races;
mod restart;
mod retention;
mod service;
mod sse;
mod store_contract;
mod stores;
mod support;
mod upgrade;
mod waiting;
