// Shared helpers for the k6 scenarios: node list, admin calls, voucher creation, and the
// server-side count of created reservations (read from every node's /metrics).
import http from 'k6/http';
import { check, fail } from 'k6';
import { Counter } from 'k6/metrics';

export const BASES = (__ENV.BASE_URLS || __ENV.BASE_URL || 'http://127.0.0.1:8080')
  .split(',')
  .map((s) => s.trim())
  .filter((s) => s.length > 0);
export const TOKEN = __ENV.ADMIN_TOKEN || '';
export const JSON_HEADERS = { 'Content-Type': 'application/json' };
// Set-up and check calls are not load: any 2xx is what they expect.
const SETUP = { responseCallback: http.expectedStatuses({ min: 200, max: 299 }), tags: { kind: 'setup' } };

// The reserve latency threshold (p99, ms). P99_MS=0 turns it off, for functional runs on a
// loaded machine (CI) where speed is measured separately, not asserted.
const P99_MS = parseInt(__ENV.P99_MS || '100', 10);
export function latencyThreshold() {
  return P99_MS > 0 ? { 'http_req_duration{kind:reserve}': [`p(99)<${P99_MS}`] } : {};
}

export function base(i) {
  return BASES[i % BASES.length];
}

function admin() {
  if (!TOKEN) fail('set ADMIN_TOKEN (the admin bearer token of the nodes)');
  return { 'Content-Type': 'application/json', Authorization: `Bearer ${TOKEN}` };
}

// Creates a voucher with a unique code and returns the code.
export function createVoucher(prefix, totalLimit, perUserLimit) {
  const code = `${prefix}-${Date.now().toString(36)}`.slice(0, 32);
  const body = {
    code,
    discountAmount: 1000,
    minOrderAmount: 0,
    totalLimit,
    perUserLimit,
    startsAt: '2020-01-01T00:00:00Z',
    endsAt: '2099-01-01T00:00:00Z',
  };
  const res = http.post(`${BASES[0]}/admin/vouchers`, JSON.stringify(body), Object.assign({ headers: admin() }, SETUP));
  if (res.status !== 201) fail(`create voucher: ${res.status} ${res.body}`);
  return code;
}

export function warm(code) {
  for (const b of BASES) {
    const res = http.post(`${b}/admin/vouchers/${code}/warm`, null, Object.assign({ headers: admin() }, SETUP));
    if (res.status !== 204) fail(`warm ${b}: ${res.status} ${res.body}`);
  }
}

export function adminView(code) {
  const res = http.get(`${BASES[0]}/admin/vouchers/${code}`, Object.assign({ headers: admin() }, SETUP));
  if (res.status !== 200) fail(`admin view: ${res.status} ${res.body}`);
  return res.json();
}

// Sum over the nodes of vouchers_reservations_total{outcome="created"}.
export function createdOnServers() {
  let total = 0;
  for (const b of BASES) {
    const text = http.get(`${b}/metrics`, SETUP).body || '';
    for (const line of text.split('\n')) {
      if (line.startsWith('vouchers_reservations_total{') && line.includes('outcome="created"')) {
        total += parseFloat(line.split(' ').pop());
      }
    }
  }
  return total;
}

export function reserve(node, code, customerId, orderId, tags) {
  return http.post(
    `${base(node)}/vouchers/${code}/reservations`,
    JSON.stringify({ customerId, orderId, orderAmount: 10000 }),
    { headers: JSON_HEADERS, tags: Object.assign({ kind: 'reserve' }, tags || {}) },
  );
}

// The clients' own view of the books: each client adds one for every new order it saw a 201
// for (`sawCreated`), and the teardown takes away every reservation the ledger holds for the
// voucher (`checkLedger`). k6 counts the teardown's samples too, so the threshold of
// `ledgerMatchesClients()` fails the run when the ledger and the clients disagree, in either
// direction: a 201 the ledger lost, or a reservation no client was told of.
const clientsMinusLedger = new Counter('reservations_clients_minus_ledger');

export function sawCreated() {
  clientsMinusLedger.add(1);
}

export function ledgerMatchesClients() {
  return { reservations_clients_minus_ledger: ['count==0'] };
}

// The accounting check every scenario ends with: the ledger balances, never more than the total
// was sold, and the ledger holds exactly as many reservations as the servers answered 201. In a
// scenario whose clients count with `sawCreated`, it also settles their count against the ledger;
// `copies` is how many 201s each reservation answers (a retry storm sends each order that often).
export function checkLedger(code, createdBefore, expectSold, copies) {
  const v = adminView(code);
  const sold = v.reserved + v.confirmed + v.released;
  clientsMinusLedger.add(-sold * (copies || 1));
  const created = createdOnServers() - createdBefore;
  const ok = check(v, {
    'ledger balanced': (x) => x.balanced === true,
    'never more than totalLimit sold': (x) => x.reserved + x.confirmed <= x.totalLimit,
    'ledger reservations = 201s': () => sold === created,
    'expected units sold': () => expectSold === undefined || sold === expectSold,
  });
  console.log(`voucher ${code}: ledger ${JSON.stringify(v.counters)}; 201s counted by the servers: ${created}`);
  if (!ok) fail(`accounting check failed for ${code}: sold ${sold}, 201s ${created}`);
}
