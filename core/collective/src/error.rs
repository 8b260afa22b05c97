//! Errors of the collective layer. Messages are one line and name the rank, the variable or the
//! collective.

/// What went wrong setting up or running a collective.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The launcher's environment is inconsistent (`WORLD_SIZE` without `RANK`, a bad number).
    #[error("distributed environment: {0}")]
    Env(String),
    /// Rendezvous or process-group construction failed (unreachable `MASTER_ADDR`, a port in use).
    #[error("rank {rank}: cannot join the process group at {addr}: {message}")]
    Init { rank: usize, addr: String, message: String },
    /// A collective failed or timed out (a peer died or stopped answering).
    #[error("rank {rank}: {op} failed (another rank exited or stopped responding?): {message}")]
    Op { rank: usize, op: &'static str, message: String },
    /// A tensor libtorch refused.
    #[error("rank {rank}: {0}", rank = .1)]
    Torch(tch::TchError, usize),
    /// CUDA tensors need the NCCL library, which this build or machine lacks.
    #[error("NCCL: {0}")]
    Nccl(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, CollectiveError>;

/// The first line of a C++ message (c10d messages can carry context lines).
pub(crate) fn one_line(message: &str) -> String {
    let line = message.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("(no message)");
    line.to_string()
}
