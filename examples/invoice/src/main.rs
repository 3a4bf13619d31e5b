//! `invoice-worker`: a leasehold worker serving the `invoice` kind. Every
//! flag and `LH_*` variable of `leasehold-worker` works here (`--help`);
//! `INVOICE_ACCOUNTING_URL` is where the accounting system is (default
//! `http://127.0.0.1:8089`, the simulator's). `INVOICE_AMOUNT_BIAS` (tests
//! only) adds to every amount: a code change between attempts.

use invoice_agent::{CreateInvoice, Invoice, LookupSupplier};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let accounting = std::env::var("INVOICE_ACCOUNTING_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:8089".to_string());
    let amount_bias = match std::env::var("INVOICE_AMOUNT_BIAS") {
        Ok(v) => v
            .parse()
            .map_err(|e| anyhow::anyhow!("INVOICE_AMOUNT_BIAS={v}: {e}"))?,
        Err(_) => 0.0,
    };
    leasehold::Worker::from_env()
        .kind("invoice", Invoice { amount_bias })
        .tool(LookupSupplier::new(&accounting))
        .tool(CreateInvoice::new(&accounting))
        .run()
        .await
}
