//! The invoice agent (the Levy Street guide's example) as a leasehold kind,
//! built against the public `leasehold` crate only.
//!
//! A job's input is a supplier's email. The kind parses it (a step), looks
//! the supplier up (a read tool), asks a person when the amount is above a
//! threshold (`ctx.park`), and creates the invoice in the accounting system
//! (a write tool with a business key on supplier + invoice number and a
//! `find_existing` lookup by that key): exactly one invoice, whatever
//! crashes, timeouts, retries or repeated requests happen on the way.

use std::time::Duration;

use leasehold::{
    async_trait, BoxFuture, Ctx, Error, ExecCtx, Kind, Reconcile, Tool, ToolError, ToolKind,
    ToolSpec,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The job's input.
#[derive(Debug, Deserialize)]
pub struct Input {
    pub email: Email,
    /// Amounts above this need a person's approval (`review resume --answer
    /// '{"approve": true}'`).
    #[serde(default)]
    pub approval_over: Option<f64>,
    /// Asks for the same invoice again in a later step (as a model that
    /// forgot it did): the business key answers with the first one.
    #[serde(default)]
    pub ask_again: bool,
}

#[derive(Debug, Deserialize)]
pub struct Email {
    pub from: String,
    pub body: String,
}

/// What the email says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parsed {
    pub supplier: String,
    pub number: String,
    pub amount: f64,
}

/// Reads "Invoice <number> from <supplier>: <amount> EUR" from the body.
pub fn parse(body: &str) -> Result<Parsed, String> {
    let rest = body
        .split_once("Invoice ")
        .ok_or("no \"Invoice <number> from <supplier>: <amount>\" in the email")?
        .1;
    let (number, rest) = rest.split_once(" from ").ok_or("no \"from <supplier>\"")?;
    let (supplier, rest) = rest.split_once(':').ok_or("no \": <amount>\"")?;
    let amount = rest
        .split_whitespace()
        .next()
        .and_then(|a| a.replace(',', "").parse::<f64>().ok())
        .ok_or("the amount is not a number")?;
    Ok(Parsed {
        supplier: supplier.trim().to_string(),
        number: number.trim().to_string(),
        amount,
    })
}

/// The `invoice` kind.
#[derive(Default)]
pub struct Invoice {
    /// Added to every amount (`INVOICE_AMOUNT_BIAS`): for tests, a code
    /// change between two attempts of one job.
    pub amount_bias: f64,
}

#[async_trait]
impl Kind for Invoice {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let input: Input = ctx.input()?;
        let parsed: Parsed = ctx
            .step("parse", || async {
                parse(&input.email.body)
                    .map_err(|e| Error::terminal(format!("email from {}: {e}", input.email.from)))
            })
            .await?;
        let supplier = ctx
            .call("lookup_supplier", json!({"name": parsed.supplier}))
            .await?;
        if input.approval_over.is_some_and(|t| parsed.amount > t) {
            let answer = ctx
                .park(
                    "approval",
                    &format!(
                        "create invoice {} of {} for {:.2} EUR? answer {{\"approve\": true}} or false",
                        parsed.number, parsed.supplier, parsed.amount
                    ),
                )
                .await?;
            if answer["approve"] != true {
                return Err(Error::terminal(format!(
                    "invoice {} refused by the reviewer",
                    parsed.number
                )));
            }
        }
        let args = json!({
            "supplier": parsed.supplier,
            "supplier_id": supplier["id"],
            "number": parsed.number,
            "amount": parsed.amount + self.amount_bias,
        });
        let invoice = ctx.call("create_invoice", args.clone()).await?;
        let note: String = ctx
            .step("note", || async {
                Ok(format!("invoice {} booked", invoice["id"]))
            })
            .await?;
        let mut out = json!({"invoice": invoice, "note": note});
        if input.ask_again {
            // Steps later, the same invoice asked for again.
            let _: u32 = ctx.step("pause", || async { Ok(1) }).await?;
            out["again"] = ctx.call("create_invoice", args).await?;
        }
        Ok(out)
    }
}

/// `lookup_supplier`: a read of the accounting system's suppliers.
pub struct LookupSupplier {
    spec: ToolSpec,
    base: String,
    http: reqwest::Client,
}

impl LookupSupplier {
    /// Against the accounting system at `base` (e.g. `http://127.0.0.1:8089`).
    pub fn new(base: &str) -> Self {
        LookupSupplier {
            spec: ToolSpec {
                name: "lookup_supplier".into(),
                description: "Find a supplier in the accounting system by name.".into(),
                kind: ToolKind::Read,
                schema: json!({"type": "object", "properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"], "additionalProperties": false}),
                timeout: Duration::from_secs(5),
            },
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
        }
    }
}

/// A response as a tool result: JSON on success, the status otherwise.
async fn answer(
    r: Result<reqwest::Response, reqwest::Error>,
    timeout: Duration,
) -> Result<Value, ToolError> {
    // The one rule for "may the request have been sent" (a refused
    // connection was not; anything later may have been).
    let r = r.map_err(|e| ToolError::from_reqwest(e, timeout))?;
    let status = r.status().as_u16();
    let body: Value = r
        .json()
        .await
        .map_err(|e| ToolError::BadResponse(e.to_string()))?;
    if (200..300).contains(&status) {
        return Ok(body);
    }
    Err(ToolError::Upstream {
        status,
        message: body["error"]["message"].as_str().unwrap_or("").to_string(),
    })
}

impl Tool for LookupSupplier {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn endpoint(&self) -> String {
        format!("{}/accounting/suppliers", self.base)
    }
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        _ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(async move {
            let name = args["name"].as_str().unwrap_or_default();
            answer(
                self.http
                    .get(self.endpoint())
                    .query(&[("name", name)])
                    .send()
                    .await,
                self.spec.timeout,
            )
            .await
        })
    }
}

/// `create_invoice`: the write. Its business key is supplier + invoice
/// number (the accounting system's own uniqueness), and `find_existing`
/// looks the invoice up by it before any retry.
pub struct CreateInvoice {
    spec: ToolSpec,
    base: String,
    http: reqwest::Client,
}

impl CreateInvoice {
    /// Against the accounting system at `base`.
    pub fn new(base: &str) -> Self {
        CreateInvoice {
            spec: ToolSpec {
                name: "create_invoice".into(),
                description: "Create an invoice in the accounting system.".into(),
                kind: ToolKind::Write,
                schema: json!({"type": "object", "properties": {
                    "supplier": {"type": "string", "minLength": 1},
                    "supplier_id": {"type": "string"},
                    "number": {"type": "string", "minLength": 1},
                    "amount": {"type": "number", "exclusiveMinimum": 0}
                }, "required": ["supplier", "number", "amount"], "additionalProperties": false}),
                timeout: Duration::from_secs(3),
            },
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
        }
    }
    fn url(&self) -> String {
        format!("{}/accounting/invoices", self.base)
    }
}

impl Tool for CreateInvoice {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn endpoint(&self) -> String {
        self.url()
    }
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(async move {
            let r = self
                .http
                .post(self.url())
                .header("Idempotency-Key", &ctx.idempotency_key)
                .json(args)
                .send()
                .await;
            match answer(r, self.spec.timeout).await {
                // The accounting system already has this invoice: that is
                // the effect, not a failure.
                Err(ToolError::Upstream { status: 409, .. }) => self
                    .lookup(args)
                    .await
                    .map_err(|e| ToolError::BadResponse(format!("409, then the lookup: {e}"))),
                other => other,
            }
        })
    }
    fn business_key(&self, _job_id: &str, args: &Value) -> Option<String> {
        Some(format!(
            "invoice:{}:{}",
            args["supplier"].as_str()?,
            args["number"].as_str()?
        ))
    }
    fn find_existing<'a>(&'a self, _key: &'a str, args: &'a Value) -> BoxFuture<'a, Reconcile> {
        Box::pin(async move {
            match self.lookup(args).await {
                Ok(v) if v["status"] == "ambiguous" => Reconcile::Unknowable(format!(
                    "the accounting system cannot tell whether invoice {} exists: {}",
                    args["number"], v["message"]
                )),
                Ok(v) => Reconcile::Found(v),
                Err(ToolError::Upstream { status: 404, .. }) => Reconcile::NotFound,
                Err(e) => Reconcile::Unavailable(e.to_string()),
            }
        })
    }
}

impl CreateInvoice {
    async fn lookup(&self, args: &Value) -> Result<Value, ToolError> {
        let q = [
            ("supplier", args["supplier"].as_str().unwrap_or_default()),
            ("number", args["number"].as_str().unwrap_or_default()),
        ];
        answer(
            self.http.get(self.url()).query(&q).send().await,
            self.spec.timeout,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_invoice_from_the_email() {
        assert_eq!(
            parse("Hello,\nInvoice F-17 from ACME Tools: 1,200.50 EUR, due in 30 days.").unwrap(),
            Parsed {
                supplier: "ACME Tools".into(),
                number: "F-17".into(),
                amount: 1200.5
            }
        );
        assert!(parse("Hi, see attached.").is_err());
        assert!(parse("Invoice F-1 from X: lots").is_err());
    }

    #[test]
    fn the_business_key_is_supplier_and_number() {
        let t = CreateInvoice::new("http://x");
        let a = json!({"supplier": "ACME", "number": "F-17", "amount": 1.0});
        let b = json!({"supplier": "ACME", "number": "F-17", "amount": 2.0, "supplier_id": "s"});
        assert_eq!(t.business_key("j1", &a), t.business_key("j2", &b));
        assert_eq!(t.business_key("j", &a).unwrap(), "invoice:ACME:F-17");
    }
}
