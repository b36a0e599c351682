// Checkout lifecycle: reserve, retry the same orderId, then confirm (70%), release (20%) or
// abandon (10%, left to expire).
//   k6 run -e ADMIN_TOKEN=… -e RATE=500 load-tests/lifecycle.js
import exec from 'k6/execution';
import { check } from 'k6';
import http from 'k6/http';
import { base, createVoucher, checkLedger, ledgerMatchesClients, reserve, sawCreated, sawSettled, warm, latencyThreshold } from './lib.js';

const RATE = parseInt(__ENV.RATE || '500', 10);

http.setResponseCallback(http.expectedStatuses(200, 201));

export const options = {
  scenarios: {
    checkout: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: __ENV.DURATION || '15s',
      preAllocatedVUs: 200,
      maxVUs: 1000,
    },
  },
  thresholds: Object.assign(latencyThreshold(), ledgerMatchesClients(), {
    checks: ['rate==1.0'],
    http_req_failed: ['rate==0'],
  }),
  summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'max'],
};

export function setup() {
  const code = createVoucher('LIFE', 10000000, 1);
  warm(code);
  return { code };
}

export default function (data) {
  const customer = exec.scenario.iterationInTest + 1;
  const order = `${data.code}-${customer}`;
  const first = reserve(customer, data.code, customer, order);
  const retry = reserve(customer + 1, data.code, customer, order, { retry: 'yes' });
  check(first, { 'reserve 201': (r) => r.status === 201 });
  // One new order, whatever the retry saw (it must be the same reservation).
  if (first.status === 201 || retry.status === 201) sawCreated(order);
  check(retry, {
    'retry 201': (r) => r.status === 201,
    'retry gets the same body': (r) => r.body === first.body,
  });
  const roll = (customer * 7919) % 10;
  const url = `${base(customer)}/vouchers/${data.code}/reservations/${encodeURIComponent(order)}`;
  if (roll < 7) {
    const res = http.post(`${url}/confirm`, null, { tags: { kind: 'confirm' } });
    check(res, { 'confirm 200 CONFIRMED': (r) => r.status === 200 && r.json('status') === 'CONFIRMED' });
    if (res.status === 200) sawSettled(order, 'CONFIRMED');
  } else if (roll < 9) {
    const res = http.del(url, null, { tags: { kind: 'release' } });
    check(res, { 'release 200 RELEASED': (r) => r.status === 200 && r.json('status') === 'RELEASED' });
    if (res.status === 200) sawSettled(order, 'RELEASED');
  }
}

export function teardown(data) {
  checkLedger(data.code);
}
